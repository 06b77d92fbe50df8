"""One check's pipeline: where its reference comes from, how it is judged, and what it records."""

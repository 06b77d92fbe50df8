"""One check's pipeline, piece by piece (``settings``: which tolerance, verdict policy, layer limit,
audit budget and train store a check is judged by)."""

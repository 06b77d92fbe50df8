"""One check's pipeline, piece by piece: which settings it is judged by (``settings``), where its
reference comes from (``reference``), how it is judged (``verdict``) and what it records (``record``)."""

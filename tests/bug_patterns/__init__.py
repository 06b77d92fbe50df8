"""Small modules with exactly one device-propagation bug each, and their fixed versions.

Each module defines ``Buggy`` (or several buggy variants) and ``Fixed`` ``nn.Module`` classes and
``make_input()``. The line that causes the bug carries a ``# BUG`` comment; the audit tests look
that line up and assert that the audit's event points at it.
"""

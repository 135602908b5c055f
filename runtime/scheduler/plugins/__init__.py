"""The scheduler's plug-ins: each reaches the scheduler only through the handle protocol (base.py)."""

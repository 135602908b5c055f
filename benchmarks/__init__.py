"""Benchmarks, run as scripts (python benchmarks/NAME.py); importable for the pieces tests share."""

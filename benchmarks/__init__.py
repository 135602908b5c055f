"""Benchmarks, run from the repository root as `python -m benchmarks.NAME` (not part of the furcate package: they
import furcate as installed); importable for the pieces tests share."""

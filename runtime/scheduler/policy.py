"""Orders the waiting queue before admission. Cache-aware policies plug in here once a prefix cache exists."""

from __future__ import annotations

import random

from .req import Req


def order_waiting(waiting: list[Req], policy: str, rng: random.Random) -> list[Req]:
    if policy == "fcfs":
        return list(waiting)
    if policy == "lof":  # longest output first: long jobs start early, so the batch drains evenly
        return sorted(waiting, key=lambda r: -r.params.max_new_tokens)
    if policy == "random":
        shuffled = list(waiting)
        rng.shuffle(shuffled)
        return shuffled
    raise ValueError(f"unknown schedule_policy {policy!r}")

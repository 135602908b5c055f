"""Speculative decoding: drafting a request's next tokens cheaply (ngram.py) and verifying them in one forward
(verify.py). The scheduler's seam to them is scheduler/plugins/speculation.py."""

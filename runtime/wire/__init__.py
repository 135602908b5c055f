"""Leaf types both processes share: the engine<->scheduler messages, weight-update messages, finish reasons and
tensor specs. Nothing here imports another runtime package."""

"""Multimodal inputs: turning what a user passes as an image into checked, hashed pixels."""

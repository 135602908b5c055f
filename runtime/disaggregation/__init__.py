"""Prefill/decode disaggregation: a prefill server computes prompts and writes their K/V straight into the KV slots
a decode server reserved, through a transfer engine (Mooncake or NIXL); the two pair up by bootstrap_room."""

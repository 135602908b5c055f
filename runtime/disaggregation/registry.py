"""The disaggregation sides (engine argument disaggregation_mode) and KV transfer backends
(disaggregation_transfer_backend) by name, beside their implementations: config's validation and CLI choices, the
scheduler's plug-in lookup and transfer.make_agent all read these entries (runtime/registry.py).

Each is named by import path, so naming one imports neither it nor its transfer engine (Mooncake, NIXL).
"""

from __future__ import annotations

from .. import registry

MODE = "disaggregation_mode"
TRANSFER_BACKEND = "disaggregation_transfer_backend"
NULL = "null"  # serving whole requests: no scheduler plug-in

registry.register(MODE, NULL)
registry.register(MODE, "prefill", f"{__package__}.prefill:PrefillSender")
registry.register(MODE, "decode", f"{__package__}.decode:DecodeReceiver")
registry.register(TRANSFER_BACKEND, "mooncake", f"{__package__}.transfer:MooncakeAgent")
registry.register(TRANSFER_BACKEND, "nixl", f"{__package__}.nixl_agent:NixlAgent")

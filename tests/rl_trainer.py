"""A trainer process as slime and AReaL run one beside SGLang: rank 0 of a gloo group, broadcasting new weights.

`python rl_trainer.py MODEL_DIR ADDRESS PORT WORLD_SIZE GROUP`: joins the group, then for each line on stdin
("ROUND" or "die ROUND") broadcasts round_weights(MODEL_DIR, ROUND) tensor by tensor in state_dict order and
prints "sent"; with "die" it exits after half of them, as a trainer that crashes mid-update.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM


def round_weights(model_dir: Path | str, round_number: int) -> dict[str, torch.Tensor]:
    """The checkpoint's weights, scaled by a seeded random factor per element: a new model each round."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(round_number)
    weights = {}
    for name, tensor in model.state_dict().items():
        noise = torch.randn(tensor.shape, generator=generator)
        weights[name] = (tensor * (1 + 0.5 * noise)).contiguous()
    return weights


def main() -> None:
    from furcate.runtime.distributed.weight_group import init_weight_group

    model_dir, address, port, world_size, group_name = sys.argv[1:6]
    group = init_weight_group(address, int(port), 0, int(world_size), group_name, "gloo", timeout_s=120)
    print("joined", flush=True)
    for line in sys.stdin:
        words = line.split()
        tensors = list(round_weights(model_dir, int(words[-1])).values())
        for i, tensor in enumerate(tensors):
            if words[0] == "die" and i == len(tensors) // 2:
                os._exit(1)
            dist.broadcast(tensor, src=0, group=group)
        print("sent", flush=True)


if __name__ == "__main__":
    main()

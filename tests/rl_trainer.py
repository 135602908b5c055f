"""A trainer process as slime and AReaL run one beside SGLang: rank 0 of a gloo group, driving the server over HTTP.

`python rl_trainer.py MODEL_DIR SERVER_URL API_KEY PORT GROUP`: joins the group with the server
(/init_weights_update_group, once) and prints "joined"; then for each line on stdin, "ROUND" runs a round:
/pause_generation, /update_weights_from_distributed while it broadcasts round_weights(MODEL_DIR, ROUND) tensor by
tensor, /continue_generation, and prints the update's reply. "die ROUND" exits after broadcasting half of the
tensors, as a trainer that crashes mid-update.
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM


def round_weights(model_dir: Path | str, round_number: int) -> dict[str, torch.Tensor]:
    """The checkpoint's weights, scaled by a seeded random factor per element: a new model each round (a tied LM
    head stays the embedding's tensor)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(round_number)
    weights, by_storage = {}, {}
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr()
        if key not in by_storage:
            noise = torch.randn(tensor.shape, generator=generator)
            by_storage[key] = (tensor * (1 + 0.5 * noise)).contiguous()
        weights[name] = by_storage[key]
    return weights


class Trainer:
    def __init__(self, model_dir: str, url: str, api_key: str) -> None:
        self.model_dir, self.url = model_dir, url
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.pool = ThreadPoolExecutor(1)

    def post(self, path: str, body: dict) -> dict:
        return requests.post(self.url + path, json=body, headers=self.headers, timeout=300).json()

    def join(self, port: int, group_name: str) -> dist.ProcessGroup:
        from furcate.runtime.distributed.weight_group import init_weight_group

        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": group_name, "backend": "gloo", "timeout": 60}
        reply = self.pool.submit(self.post, "/init_weights_update_group", body)
        group = init_weight_group("127.0.0.1", port, 0, 2, group_name, "gloo", timeout_s=60)
        assert reply.result()["success"], reply.result()
        return group

    def round(self, group: dist.ProcessGroup, group_name: str, round_number: int, die: bool) -> dict:
        weights = round_weights(self.model_dir, round_number)
        assert self.post("/pause_generation", {"mode": "abort"})["success"]
        body = {"names": list(weights), "dtypes": ["float32"] * len(weights),
                "shapes": [list(t.shape) for t in weights.values()], "group_name": group_name,
                "flush_cache": True, "weight_version": f"round-{round_number}"}
        reply = self.pool.submit(self.post, "/update_weights_from_distributed", body)
        for i, tensor in enumerate(weights.values()):
            if die and i == len(weights) // 2:
                os._exit(1)
            dist.broadcast(tensor, src=0, group=group)
        result = reply.result()
        assert self.post("/continue_generation", {})["success"]
        return result


def main() -> None:
    model_dir, url, api_key, port, group_name = sys.argv[1:6]
    trainer = Trainer(model_dir, url, api_key)
    group = trainer.join(int(port), group_name)
    print("joined", flush=True)
    for line in sys.stdin:
        words = line.split()
        print(json.dumps(trainer.round(group, group_name, int(words[-1]), words[0] == "die")), flush=True)


if __name__ == "__main__":
    main()

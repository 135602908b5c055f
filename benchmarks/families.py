"""Tokens per second of every family at one small-but-realistic shape (random weights), furcate against HF
transformers' generate on the same weights, to catch a family whose path is slow.

Per family, in one process, one after the other with the same thread count, float32 (so greedy outputs can be
compared token for token):
  batch   8 prompts of 48-80 tokens at once, 64 new tokens each (HF: one left-padded generate call)
  single  the first of them (48 tokens), 64 new tokens (batch-1 decode)
The report gives output tokens per second of each, the ratio furcate / HF, and how many of the greedy outputs
agree. It prints and records the CPU flags and the load before and after; run it on an idle machine.

    python -m benchmarks.families [--families gemma2,olmo2] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import tempfile
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen3MoeConfig

from benchmarks.peers_report import cpu_flags
from furcate import Engine
from furcate.runtime.model.weights.default_model import prepare_default_model

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the families' configs are the tests' (tiny_families.py)
from tiny_families import COMMON, FAMILY_CONFIGS, FAMILY_NAMES  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

# A 60M-parameter decoder (most of it the 49k-token embedding): big enough that matmuls, not Python, dominate HF's
# step, small enough for a 2-core run of every family in minutes.
SHAPE = COMMON | {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
                  "num_key_value_heads": 4, "max_position_embeddings": 2048}
NEW_TOKENS = 64
# Mixture-of-experts families at the same shape: 8 experts of a quarter of the dense MLP's width, top 2.
MOE_CONFIGS = {
    "qwen3_moe": lambda shape: Qwen3MoeConfig(**shape, num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=shape["intermediate_size"] // 4),
    "mixtral": lambda shape: MixtralConfig(**shape | {"intermediate_size": shape["intermediate_size"] // 4},
                                           num_local_experts=8, num_experts_per_tok=2),
}
# Llama, the family every other extends, as the baseline a slow family stands out against.
BASELINE = {"llama": lambda shape: LlamaConfig(**shape, tie_word_embeddings=True)}
CONFIGS = BASELINE | FAMILY_CONFIGS | MOE_CONFIGS
RESULTS = HERE / "results"


def prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (48 + 4 * i,), generator=generator).tolist() for i in range(count)]


def furcate_run(model_dir: pathlib.Path, batch: list[list[int]], threads: int) -> dict:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    with Engine(str(model_dir), dtype="float32", quantization="none", grammar_backend="none",
                torch_num_threads=threads) as engine:
        engine.generate(input_ids=batch[:1], sampling_params=params)  # warm-up
        return {name: timed(lambda ids=ids: [r["output_ids"] for r in
                                             engine.generate(input_ids=ids, sampling_params=params)])
                for name, ids in (("batch", batch), ("single", batch[:1]))}


def hf_run(model_dir: pathlib.Path, batch: list[list[int]], threads: int) -> dict:
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_generate(model, batch[:1])  # warm-up
    return {name: timed(lambda ids=ids: hf_generate(model, ids)) for name, ids in (("batch", batch),
                                                                                  ("single", batch[:1]))}


@torch.inference_mode()
def hf_generate(model, batch: list[list[int]]) -> list[list[int]]:
    width = max(len(ids) for ids in batch)
    input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids in batch])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


def timed(run) -> dict:
    started = time.perf_counter()
    outputs = run()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens_per_s": sum(map(len, outputs)) / seconds, "outputs": outputs}


def compare(ours: dict, hf: dict) -> dict:
    table = {}
    for workload in ("batch", "single"):
        mine, theirs = ours[workload], hf[workload]
        same = sum(a == b for a, b in zip(mine["outputs"], theirs["outputs"]))
        table[workload] = {"furcate_tok_s": round(mine["tokens_per_s"], 1),
                           "hf_tok_s": round(theirs["tokens_per_s"], 1),
                           "ratio": round(mine["tokens_per_s"] / theirs["tokens_per_s"], 2),
                           "greedy_equal": f"{same}/{len(mine['outputs'])}"}
    return table


def markdown(report: dict) -> str:
    lines = [f"# Families: furcate vs HF generate ({report['date']})", "",
             f"CPU flags: {report['cpu_flags'] or 'none'}; threads {report['threads']}; load before "
             f"{report['load_before']}, after {report['load_after']}; torch {report['torch']}, transformers "
             f"{report['transformers']}; shape {report['shape']}", "",
             "| family | batch 8: furcate tok/s | HF tok/s | ratio | greedy equal | batch 1: furcate tok/s | HF tok/s "
             "| ratio | greedy equal |", "|---|---|---|---|---|---|---|---|---|"]
    for family, row in report["families"].items():
        b, s = row["batch"], row["single"]
        lines.append(f"| {family} | {b['furcate_tok_s']} | {b['hf_tok_s']} | {b['ratio']} | {b['greedy_equal']} | "
                     f"{s['furcate_tok_s']} | {s['hf_tok_s']} | {s['ratio']} | {s['greedy_equal']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join([*BASELINE, *FAMILY_NAMES, *sorted(MOE_CONFIGS)]))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    report = {"date": datetime.date.today().isoformat(), "cpu_flags": cpu_flags(), "threads": args.threads,
              "load_before": [round(x, 2) for x in os.getloadavg()], "torch": torch.__version__,
              "transformers": transformers.__version__, "shape": {k: SHAPE[k] for k in
                                                                   ("hidden_size", "num_hidden_layers")},
              "families": {}}
    print(f"CPU flags: {report['cpu_flags']}, load {report['load_before']}", flush=True)
    batch = prompts(8, seed=0)
    tokenizer_dir = prepare_default_model(progress=None)
    with tempfile.TemporaryDirectory() as root:
        for family in args.families.split(","):
            model_dir = build_tiny_model(family, pathlib.Path(root) / family, tokenizer_dir,
                                         config=CONFIGS[family](SHAPE))
            report["families"][family] = compare(furcate_run(model_dir, batch, args.threads),
                                                 hf_run(model_dir, batch, args.threads))
            print(family, report["families"][family], flush=True)
    report["load_after"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "families.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / "families.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

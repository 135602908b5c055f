"""GPU decode and prefill speed of a ~0.5B-class model with random bf16 weights (built from a config; nothing is
downloaded), against the GPU's measured copy bandwidth.

Measured, on one CUDA device:
- decode tokens/s at batch 1, 8, 64 and 256, with and without CUDA graphs. Each is the difference of two runs
  that differ only in output length (16 and 144 new tokens), so prefill and start-up cancel out;
- prefill tokens/s (8 prompts of 1024 tokens, one new token each);
- at batch 1 with graphs, the share of the copy bandwidth achieved: the bytes a decode step must read (every
  weight once, plus the request's K/V) divided by the step time, over a device-to-device copy's bandwidth;
- the overlap loop against the plain loop at batch 64 (graphs on).
Aims (issue 14): >= 70% of bandwidth at batch 1 with graphs; overlap ahead of plain at batch 64.

Run on a GPU machine: benchmarks/gpu_check.sh (which also runs the GPU tests and prints one table), or
`python -m benchmarks.gpu --tokenizer DIR --out DIR`. Writes gpu.json and gpu.md under --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

HALF_B = dict(  # Qwen2.5-0.5B's shape, with the default model's vocabulary (its tokenizer drives the engine)
    vocab_size=49152, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1000000.0,
)
PROMPT_LEN = 32
SHORT, LONG = 16, 144
DECODE_BATCHES = (1, 8, 64, 256)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def build_model(directory: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**HALF_B), dtype=torch.bfloat16)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


def copy_bandwidth(device: str, gib: int = 4) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written (best of 10)."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(12):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return 2 * src.numel() / best


def timed_generate(engine, batch: int, prompt_len: int, new_tokens: int) -> float:
    prompts = [[(7 * i + j) % 40000 + 100 for j in range(prompt_len)] for i in range(batch)]
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    outputs = engine.generate(input_ids=prompts, sampling_params=[params] * batch)
    elapsed = time.perf_counter() - started
    assert all(len(out["output_ids"]) == new_tokens for out in outputs)
    return elapsed


def decode_rate(engine, batch: int) -> float:
    """Decode tokens/s over the whole batch; prefill and fixed costs cancel in the difference of two runs."""
    engine.flush_cache()
    short = timed_generate(engine, batch, PROMPT_LEN, SHORT)
    engine.flush_cache()
    long = timed_generate(engine, batch, PROMPT_LEN, LONG)
    return batch * (LONG - SHORT) / (long - short)


def engine_for(model_dir: Path, graphs: bool, overlap: bool):
    from furcate.runtime.engine.engine import Engine

    return Engine(str(model_dir), device="cuda", dtype="bfloat16", disable_cuda_graph=not graphs,
                  disable_overlap_schedule=not overlap, max_running_requests=256)


def bytes_per_decode_step(model_dir: Path, context: int) -> int:
    """Weights read once per step (bf16), plus one request's K and V over `context` tokens."""
    from furcate.runtime.executor.model_runner import checkpoint_bytes

    kv_per_token = 2 * HALF_B["num_hidden_layers"] * HALF_B["num_key_value_heads"] * (
        HALF_B["hidden_size"] // HALF_B["num_attention_heads"]) * 2
    return checkpoint_bytes(str(model_dir), torch.bfloat16) + kv_per_token * context


def measure(model_dir: Path) -> dict:
    from furcate.runtime.attention.select import flashinfer_importable

    results: dict = {"device": torch.cuda.get_device_name(), "decode": {}, "overlap": {},
                     "attention_backend": "flashinfer" if flashinfer_importable() else "triton"}
    results["copy_bandwidth_gbs"] = copy_bandwidth("cuda") / 1e9
    for graphs in (True, False):
        with engine_for(model_dir, graphs, overlap=True) as engine:
            for batch in DECODE_BATCHES:
                results["decode"][f"bs{batch}_{'graphs' if graphs else 'eager'}"] = decode_rate(engine, batch)
            if graphs:
                engine.flush_cache()
                elapsed = timed_generate(engine, 8, 1024, 1)
                results["prefill_tokens_per_s"] = 8 * 1024 / elapsed
                results["overlap"]["bs64_overlap"] = results["decode"]["bs64_graphs"]
    with engine_for(model_dir, graphs=True, overlap=False) as engine:
        results["overlap"]["bs64_plain"] = decode_rate(engine, 64)
    step_seconds = 1 / results["decode"]["bs1_graphs"]
    step_bytes = bytes_per_decode_step(model_dir, PROMPT_LEN + (SHORT + LONG) // 2)
    results["bandwidth_share_bs1"] = step_bytes / step_seconds / (results["copy_bandwidth_gbs"] * 1e9)
    return results


def table(results: dict) -> str:
    rows = ["| measure | value |", "|---|---|", f"| device | {results['device']} |",
            f"| attention backend (auto) | {results['attention_backend']} |",
            f"| copy bandwidth | {results['copy_bandwidth_gbs']:.0f} GB/s |"]
    rows += [f"| decode tok/s {name} | {rate:.0f} |" for name, rate in results["decode"].items()]
    rows += [f"| prefill tok/s (8 x 1024) | {results['prefill_tokens_per_s']:.0f} |",
             f"| bandwidth share at batch 1, graphs (aim >= 70%) | {100 * results['bandwidth_share_bs1']:.1f}% |",
             f"| batch 64 overlap / plain (aim > 1) | "
             f"{results['overlap']['bs64_overlap'] / results['overlap']['bs64_plain']:.2f} |"]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="folder with the default model's tokenizer")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(Path(tempfile.gettempdir()) / "furcate-half-b", args.tokenizer)  # not under --out
    results = measure(model_dir)
    (args.out / "gpu.json").write_text(json.dumps(results, indent=2))
    (args.out / "gpu.md").write_text(table(results) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()

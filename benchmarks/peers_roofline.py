"""The batched workloads' compute ceiling for the peers benchmark (benchmarks/peers.py): the linear layers'
arithmetic each workload needs at the least, over the best matmul rate this machine's oneDNN reaches.

Offline and shared-prefix runs are mostly prefill, and a prefill token costs two multiply-adds per weight. So no
engine, whatever its scheduling, finishes a workload faster than its linear FLOPs at the machine's matmul rate:
- prefill: every prompt token (with an ideal prefix cache, only the distinct prefix-trie nodes) through each
  layer's weights, at the rate of a 2048-row matmul;
- decode: every output token but the first through the same weights, at the rate of a matmul with one row per
  request (the batch at its fullest);
- the LM head: once per output token, at that decode rate.
Attention, norms and sampling are left out, which makes the ceiling higher, never lower. The rates are measured
here, on weights packed as furcate's and vLLM's CPU linears pack them (torch.ops.mkldnn._linear_pointwise), best
of several runs with the benchmark's thread count.
"""

from __future__ import annotations

import time

DENSE = ("float32", "bfloat16")  # the precisions vLLM runs too
PREFILL_ROWS = 2048


def model_facts(hf_dir: str) -> dict:
    """What the linear FLOPs depend on, from the HF directory's config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"hidden": config.hidden_size, "intermediate": config.intermediate_size,
            "layers": config.num_hidden_layers, "q_width": config.num_attention_heads * head_dim,
            "kv_width": config.num_key_value_heads * head_dim, "vocab": config.vocab_size}


def linear_flops(facts: dict) -> tuple[float, float]:
    """FLOPs a token costs in the layers' linears (q, k, v, o and the gated MLP) and in the LM head."""
    hidden = facts["hidden"]
    per_layer = hidden * (2 * facts["q_width"] + 2 * facts["kv_width"]) + 3 * hidden * facts["intermediate"]
    return 2.0 * facts["layers"] * per_layer, 2.0 * hidden * facts["vocab"]


def matmul_rate(dtype_name: str, rows: int, inner: int, outer: int, threads: int, repeats: int = 5) -> float:
    """GFLOP/s of [rows, inner] x packed [outer, inner]^T, best of `repeats`."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dtype = getattr(torch, dtype_name)
        x, weight = torch.randn(rows, inner, dtype=dtype), torch.randn(outer, inner, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

        def run() -> None:
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        run()
        calls = max(1, int(2e10 / (2 * rows * inner * outer)))  # ~20 GFLOP a timing
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(calls):
                run()
            best = min(best, (time.perf_counter() - started) / calls)
    finally:
        torch.set_num_threads(previous)
    return 2 * rows * inner * outer / best / 1e9


def machine_rates(facts: dict, batch: int, threads: int, precisions: list[str]) -> dict:
    """Per dense precision run: the best of the model's MLP shapes at PREFILL_ROWS rows, and at `batch` rows the MLP and
    LM-head shapes (GFLOP/s)."""
    hidden, intermediate = facts["hidden"], facts["intermediate"]
    rates = {}
    for dtype in (p for p in DENSE if p in precisions):
        prefill = max(matmul_rate(dtype, PREFILL_ROWS, hidden, intermediate, threads),
                      matmul_rate(dtype, PREFILL_ROWS, intermediate, hidden, threads))
        decode = max(matmul_rate(dtype, batch, hidden, intermediate, threads),
                     matmul_rate(dtype, batch, intermediate, hidden, threads))
        rates[dtype] = {"prefill_gflop_s": prefill, "decode_gflop_s": decode,
                        "head_gflop_s": matmul_rate(dtype, batch, hidden, facts["vocab"], threads)}
    return rates


def workload_flops(prompts: list[list[int]], output_len: int, facts: dict, shared: bool) -> dict:
    """The workload's linear FLOPs by phase (prefill tokens: the distinct prefix-trie nodes where shared)."""
    from .shared_prefix import unique_prefix_tokens

    token, head = linear_flops(facts)
    prefilled = unique_prefix_tokens(prompts) if shared else sum(map(len, prompts))
    outputs = len(prompts) * output_len
    return {"prefill_tokens": prefilled, "output_tokens": outputs, "prefill": prefilled * token,
            "decode": (outputs - len(prompts)) * token, "head": outputs * head}


def ceilings(workloads: dict, sizes: dict, facts: dict, rates: dict) -> dict:
    """Per dense precision and batched workload: the fewest seconds the linears allow and the output tok/s that
    makes at most."""
    out = {}
    for precision, rate in rates.items():
        for name in ("offline", "shared_prefix"):
            flops = workload_flops(workloads[name], sizes[name]["output_len"], facts, name == "shared_prefix")
            seconds = (flops["prefill"] / rate["prefill_gflop_s"] + flops["decode"] / rate["decode_gflop_s"]
                       + flops["head"] / rate["head_gflop_s"]) / 1e9
            out[f"{precision}/{name}"] = {**flops, "seconds": seconds, "tok_s": flops["output_tokens"] / seconds}
    return out


def shares(table: dict, ceiling: dict) -> dict:
    """Each system's tok/s as a share of its workload's ceiling, and the share 1.5x vLLM would take."""
    out = {}
    for key, bound in ceiling.items():
        row = table.get(key, {})
        measured = {system: row[system] / bound["tok_s"] for system in ("furcate", "furcate-compiled", "vllm")
                    if isinstance(row.get(system), float)}
        if "vllm" in measured:
            measured["1.5x vllm"] = 1.5 * measured["vllm"]
        out[key] = measured
    return out


def markdown_lines(report: dict) -> list[str]:
    """The report's section on the ceiling (empty where the run measured none)."""
    ceiling, rates = report.get("ceiling"), report.get("matmul_rates")
    if not ceiling:
        return []
    lines = ["", "## Batched workloads against the matmul ceiling", "",
             "The linears' FLOPs of each workload (prefill tokens: with an ideal prefix cache; decode: every output "
             "token but the first; the LM head per output token) at the best rate this machine's oneDNN reached "
             "(benchmarks/peers_roofline.py). Attention, norms and sampling are left out, so no engine can reach "
             "100%.", "",
             "| precision | matmul GFLOP/s: prefill rows | decode rows | LM head |", "|---|---|---|---|"]
    for precision, rate in rates.items():
        lines.append(f"| {precision} | {rate['prefill_gflop_s']:.0f} | {rate['decode_gflop_s']:.0f} | "
                     f"{rate['head_gflop_s']:.0f} |")
    lines += ["", "| precision / workload | prefill tokens | linear TFLOP | ceiling tok/s | furcate | compiled | "
              "vLLM | 1.5x vLLM would take |", "|---|---|---|---|---|---|---|---|"]
    for key, bound in ceiling.items():
        share = report["ceiling_shares"].get(key, {})

        def cell(name: str, share: dict = share) -> str:
            return f"{share[name]:.0%}" if name in share else "-"
        total = (bound["prefill"] + bound["decode"] + bound["head"]) / 1e12
        lines.append(f"| {key} | {bound['prefill_tokens']} | {total:.2f} | {bound['tok_s']:.0f} | {cell('furcate')} "
                     f"| {cell('furcate-compiled')} | {cell('vllm')} | {cell('1.5x vllm')} |")
    return lines

"""vLLM's CPU build as a peer: one worker process, run with vLLM's own interpreter (its venv has no furcate), that
reads a JSON spec and writes JSON results.

    /work/vllm_venv/bin/python -m benchmarks.peer_vllm SPEC.json

The spec names the HF model directory (the same weights the other systems hold, converted from the GGUF), the
dtype (float32 or bfloat16: vLLM's CPU backend has no kernels for GGUF Q4_0/Q4_1 blocks, its int4 paths take
AWQ/GPTQ checkpoints, so it has no row in the quantized comparison), the KV cache size in bytes, the sizes of
the workloads and the file with their token-id prompts. Everything else stays at vLLM's defaults, as a user gets
them: prefix caching on, chunked prefill, its default torch.compile mode (inductor on CPU), the V1 engine core in
its own process. The thread pinning (VLLM_CPU_OMP_THREADS_BIND) comes in the environment from the driver.

Only the standard library and vLLM are imported here, plus benchmarks.peers for the shared timing helpers (which
import nothing beyond the standard library and torch at module level).
"""

from __future__ import annotations

import json
import pathlib
import sys


class VllmRunner:
    """Greedy decoding through vllm.LLM.generate, prompts given as token ids."""

    def __init__(self, model_dir: str, dtype: str, kv_cache_bytes: int, max_model_len: int) -> None:
        from vllm import LLM

        self.llm = LLM(model=model_dir, dtype=dtype, enable_prefix_caching=True, kv_cache_memory_bytes=kv_cache_bytes,
                       max_model_len=max_model_len, seed=0)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def flush(self) -> None:
        # As furcate's flush_cache before each timed run: no prompt is served from an earlier run's blocks.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")

    def settings(self) -> dict:
        """What vLLM actually ran with, after its CPU platform adjusted the config."""
        config = self.llm.llm_engine.vllm_config
        compilation = config.compilation_config
        return {"dtype": str(config.model_config.dtype).removeprefix("torch."),
                "max_model_len": config.model_config.max_model_len,
                "enable_prefix_caching": config.cache_config.enable_prefix_caching,
                "block_size": config.cache_config.block_size,
                "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
                "max_num_seqs": config.scheduler_config.max_num_seqs,
                "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
                "enforce_eager": config.model_config.enforce_eager,
                "compilation_mode": getattr(compilation.mode, "name", str(compilation.mode)),
                "compilation_backend": compilation.backend,
                "executor": config.parallel_config.distributed_executor_backend}


def run(spec: dict) -> dict:
    import vllm

    from .peers import decode_summary, label, summary, timed

    workloads, sizes = json.loads(pathlib.Path(spec["workloads"]).read_text()), spec["sizes"]
    runner = VllmRunner(spec["model_dir"], spec["dtype"], spec["kv_cache_bytes"], spec["max_model_len"])
    results = {"engine": {"version": vllm.__version__, **runner.settings()}}
    runner.generate(workloads["offline"][:2], 4)
    for name in ("offline", "shared_prefix"):
        n = sizes[name]["output_len"]
        # Interleaved prompts, as furcate gets them: finding the shared prefixes is the prefix cache's job.
        runner.flush()
        outputs, seconds, foreign = timed(lambda name=name, n=n: runner.generate(workloads[name], n),
                                          label(spec, name))
        results[name] = summary(outputs, seconds, foreign)

    def decode(n: int) -> list[list[int]]:
        runner.flush()  # the prompt is prefilled in both timings
        return runner.generate([workloads["decode_b1"]], n)
    results["decode_b1"] = decode_summary(decode, sizes["decode_b1"]["output_len"], label(spec, "decode_b1"))
    return results


def main() -> None:
    spec = json.loads(pathlib.Path(sys.argv[1]).read_text())
    result = run(spec)
    pathlib.Path(spec["output"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()

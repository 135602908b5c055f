"""SGLang's own client (sglang 0.5.23's RuntimeEndpoint, default settings) runs SGLang's own test programs
(`sglang.test.test_programs`) against `furcate serve`, with no protocol error and no hang.

The server is the session's tiny llama server (random weights, the default model's tokenizer): a start costs
nothing more, and these programs generate some 3,000 tokens, which the real default model would take minutes to
decode on 2 CPU cores. Random weights answer nothing right, so the programs' own assertions split in two:

- protocol assertions (streamed logprob counts, message counts, grammar-shaped outputs, a choice among the
  choices) must hold as SGLang wrote them;
- assertions about the model's knowledge ("washington", 24 hours, "Noah", a correct product) are replaced: the
  program must still end cleanly (its own assertion about the answer may fail, nothing else may), and its greedy
  `gen` calls must give exactly the text HF transformers generates greedily on the same prompt and weights.

`test_stream_logprobs` may fail only on its client's own race (see RACY_PROGRAMS).
`test_select` and `test_parallel_encoding` run with `check_answer=False` (SGLang's own switch for their
content checks). Not run: `test_image_qa` (needs a vision model); `test_completion_speculative` and
`test_chat_completion_speculative` (API speculative execution, written for OpenAI-style backends: they read
`token_usage` and `is_chat_model`, which RuntimeEndpoint lacks, before anything reaches a server);
`test_gen_min_new_tokens` (its tokenizer helper imports sglang's server utilities, which need torchvision)."""

from __future__ import annotations

import threading
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from conftest import assert_server_pool_free

sglang = pytest.importorskip("sglang", reason="sglang is not installed (test-only: pip install --no-deps "
                                              "sglang==0.5.23, see README.md)")
test_programs = pytest.importorskip("sglang.test.test_programs")
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint  # noqa: E402 (needs the importorskip above)

PROGRAM_TIMEOUT_S = 300  # a hang guard: a program that has not ended by then hangs
# Programs whose every assertion holds on any model: they check the protocol and the grammar path.
PROTOCOL_PROGRAMS: dict[str, dict] = {
    "test_mt_bench": {}, "test_stream": {}, "test_parallel_decoding": {},
    "test_regex": {}, "test_dtype_gen": {}, "test_select": {"check_answer": False},
    "test_parallel_encoding": {"check_answer": False},
}
# Programs whose assertions judge the answer's content (or evaluate it, as test_tool_use does).
CONTENT_PROGRAMS: dict[str, dict] = {
    "test_few_shot_qa": {}, "test_decode_int": {}, "test_decode_json_regex": {}, "test_decode_json": {},
    "test_expert_answer": {}, "test_tool_use": {}, "test_react": {},
}
# test_stream_logprobs checks each chunk's new logprob entries against the change in completion_tokens. Its
# client reads only the latest chunk's meta_info when it wakes: if two chunks arrived meanwhile (a fast server),
# the first one's entries are never seen, and that comparison fails with nothing wrong on the wire
# (test_server_native checks the same counts on the raw stream). Every other assertion in it must hold.
RACY_PROGRAMS: dict[str, dict] = {"test_stream_logprobs": {}}
RACY_ASSERTION = "assert len(chunk_output_token_logprobs) =="
# Programs with greedy unconstrained gens, compared with HF.
HF_COMPARED = ("test_few_shot_qa", "test_tool_use", "test_parallel_encoding")
SGLANG_DIR = Path(sglang.__file__).parent
# The client's own code and its transport: an exception raised through any of these is a protocol failure.
CLIENT_CODE = (str(SGLANG_DIR / "lang"), str(SGLANG_DIR / "utils.py"), "/requests/", "/urllib3/", "/aiohttp/")


@dataclass(frozen=True)
class GreedyGen:
    """One non-streaming greedy gen the client sent, and what furcate answered."""
    prompt: str
    stop: tuple[str, ...]
    text: str
    completion_tokens: int


class RecordingEndpoint(RuntimeEndpoint):
    """SGLang's RuntimeEndpoint, unchanged on the wire, that remembers its greedy unconstrained gens for the HF
    comparison. `endpoint` is what test programs read on sglang's `Runtime` (an endpoint's own is itself)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self.greedy_gens: list[GreedyGen] = []

    @property
    def endpoint(self) -> RecordingEndpoint:
        return self

    def generate(self, s, sampling_params) -> tuple[str, dict]:
        prompt = s.text_
        text, meta_info = super().generate(s, sampling_params)
        constrained = sampling_params.regex is not None or sampling_params.json_schema is not None
        if sampling_params.temperature == 0 and not constrained and sampling_params.dtype is None:
            stop = sampling_params.stop
            stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
            self.greedy_gens.append(GreedyGen(prompt, stops, text, meta_info["completion_tokens"]))
        return text, meta_info


@dataclass
class ProgramRun:
    """How one program ended: its exception (None when it returned), the errors the client's executor swallowed
    into warnings, and the greedy gens it sent."""
    name: str
    error: BaseException | None = None
    executor_errors: list[str] = field(default_factory=list)
    hung: bool = False
    greedy_gens: list[GreedyGen] = field(default_factory=list)

    def protocol_failure(self) -> str | None:
        if self.hung:
            return f"{self.name} did not end within {PROGRAM_TIMEOUT_S}s"
        if self.executor_errors:  # a request error there is only a warning, then the program stalls or breaks
            return f"{self.name}: the client's executor failed: {self.executor_errors[0]}"
        if self.error is not None and raised_through_client(self.error):
            return f"{self.name}: {self.traceback()}"
        return None

    def traceback(self) -> str:
        return "".join(traceback.format_exception(self.error)) if self.error is not None else ""


def raised_through_client(error: BaseException) -> bool:
    """Whether the client or its transport raised it, rather than the program's own code (its assertion, or the
    eval of an answer): only the frames below the program's last line count, since every program runs inside the
    client's interpreter."""
    frames = traceback.extract_tb(error.__traceback__)
    program_frames = [i for i, frame in enumerate(frames) if frame.filename == test_programs.__file__]
    below_program = frames[program_frames[-1] + 1:] if program_frames else frames
    return any(part in frame.filename for frame in below_program for part in CLIENT_CODE)


def run_program(endpoint: RecordingEndpoint, name: str, kwargs: dict) -> ProgramRun:
    """One program on a thread of its own, so that a hang is reported instead of blocking the suite."""
    program: Callable[..., None] = getattr(test_programs, name)
    run = ProgramRun(name)
    endpoint.greedy_gens = run.greedy_gens

    def target() -> None:
        try:
            program(**kwargs)
        except Exception as error:  # noqa: BLE001 (kept on the run, judged by the tests)
            run.error = error

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker = threading.Thread(target=target, daemon=True, name=f"sglang-{name}")
        worker.start()
        worker.join(PROGRAM_TIMEOUT_S)
    run.hung = worker.is_alive()
    run.executor_errors = [str(w.message) for w in caught if "Error in stream_executor" in str(w.message)]
    return run


@pytest.fixture(scope="module")
def runs(tiny_server) -> dict[str, ProgramRun]:
    """Every program once, in turn, through one client as SGLang's own tests use it (the default backend)."""
    endpoint = RecordingEndpoint(tiny_server.url)
    sglang.set_default_backend(endpoint)
    try:
        programs = {**PROTOCOL_PROGRAMS, **RACY_PROGRAMS, **CONTENT_PROGRAMS}
        yield {name: run_program(endpoint, name, kwargs) for name, kwargs in programs.items()}
    finally:
        sglang.set_default_backend(None)
    assert_server_pool_free(tiny_server.url)


@pytest.mark.parametrize("name", sorted(PROTOCOL_PROGRAMS))
def test_protocol_program_passes_as_written(runs, name):
    run = runs[name]
    assert run.protocol_failure() is None, run.protocol_failure()
    assert run.error is None, run.traceback()


@pytest.mark.parametrize("name", sorted(CONTENT_PROGRAMS))
def test_content_program_ends_without_protocol_error(runs, name):
    """Its own assertion about the answer may fail on random weights; no request, stream or variable may."""
    run = runs[name]
    assert run.protocol_failure() is None, run.protocol_failure()


@pytest.mark.parametrize("name", sorted(RACY_PROGRAMS))
def test_racy_program_fails_at_most_on_the_clients_race(runs, name):
    run = runs[name]
    assert run.protocol_failure() is None, run.protocol_failure()
    if run.error is not None:
        failing_line = traceback.extract_tb(run.error.__traceback__)[-1].line
        assert isinstance(run.error, AssertionError) and failing_line.startswith(RACY_ASSERTION), run.traceback()


def hf_greedy_text(hf_model, tokenizer, gen: GreedyGen) -> str:
    """HF's greedy continuation of the same prompt for as many tokens, cut where furcate's stop rule cuts."""
    prompt_ids = torch.tensor([tokenizer.encode(gen.prompt)])
    with torch.inference_mode():
        out = hf_model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False,
                                max_new_tokens=gen.completion_tokens, pad_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(out[0, prompt_ids.shape[1]:], skip_special_tokens=True)
    cuts = [text.index(stop) for stop in gen.stop if stop in text]
    return text[: min(cuts)] if cuts else text


@pytest.mark.parametrize("name", HF_COMPARED)
def test_greedy_gens_are_the_text_hf_generates(runs, hf_reference, tokenizer, name):
    """The answers HF gives, in place of the content assertions. test_parallel_encoding's gen follows
    join("concate_and_append"), so it also checks that the joined text was computed as one prompt."""
    gens = runs[name].greedy_gens
    assert gens, f"{name} sent no greedy gen"
    hf_model = hf_reference("llama").model
    for gen in gens:
        assert gen.text == hf_greedy_text(hf_model, tokenizer, gen), gen

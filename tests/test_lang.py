"""The language as data: no torch on import, expressions, validation, dtype regexes, choice methods, tracing."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

import furcate as sgl
from furcate.lang import ChoiceScores, constant_prefix
from furcate.lang.dtypes import DTYPE_REGEX, parse_dtype
from furcate.lang.ir import Argument, Concat, Constant, Gen, RoleBegin, RoleEnd, Select


def test_importing_the_language_does_not_load_torch():
    code = "import sys, furcate, furcate.lang, furcate.interpreter; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_concatenation_flattens_strings_and_expressions():
    expr = "Q: " + sgl.gen("a", max_tokens=3) + "\n" + sgl.select("b", choices=["x", "y"])
    assert isinstance(expr, Concat)
    assert [type(p) for p in expr.parts] == [Constant, Gen, Constant, Select]
    assert expr.describe() == "text 'Q: ' + gen('a') + text '\\n' + select('b')"


def test_gen_maps_sglang_names_and_keeps_only_what_was_set():
    node = sgl.gen("x", max_tokens=7, min_tokens=1, stop="\n", temperature=0, return_logprob=True)
    assert node.sampling == {"max_new_tokens": 7, "min_new_tokens": 1, "stop": "\n", "temperature": 0}
    assert node.logprobs == {"return_logprob": True}
    assert node.constraint is None


def test_gen_with_choices_is_a_select_and_dtype_is_a_regex():
    assert isinstance(sgl.gen("c", choices=["a", "b"]), Select)
    node = sgl.gen_int("n")
    assert node.constraint.kind == "regex" and node.output_type is int
    assert sgl.gen("s", dtype="str").output_type is str


@pytest.mark.parametrize("call, message", [
    (lambda: sgl.gen(5), "variable name"),
    (lambda: sgl.gen("x", dtype=list), "dtype"),
    (lambda: sgl.gen("x", dtype=int, regex="a+"), "dtype or one of"),
    (lambda: sgl.gen("x", regex="a", json_schema={"type": "string"}), "at most one"),
    (lambda: sgl.gen("x", json_schema=3), "json_schema"),
    (lambda: sgl.select("x", choices=[]), "non-empty list"),
    (lambda: sgl.select("x", choices="ab"), "non-empty list"),
    (lambda: sgl.select("x", choices=["a", ""]), "non-empty strings"),
    (lambda: sgl.select("x", choices=["a"], temperature=float("nan")), "temperature"),
    (lambda: sgl.select("x", choices=["a"], choices_method=max), "choices_method"),
    (lambda: sgl.image(""), "image"),
    (lambda: sgl.video("v.mp4", 0), "num_frames"),
])
def test_bad_arguments_are_clear_errors_at_the_call(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_adding_non_text_is_a_clear_error():
    with pytest.raises(TypeError, match="convert values with str"):
        _ = "a" + sgl.gen("x") + 5


@pytest.mark.parametrize("dtype, good, bad", [
    (int, ["0", "-12", "+7", "2024"], ["1.5", "", "12a", " 3"]),
    (float, ["3", "-0.5", "3.14159"], ["3.", ".5", "1e5", "pi"]),
    (bool, ["True", "False"], ["true", "yes", "TrueFalse"]),
    (str, ['"hello world"', '""'], ['"a"b"', "plain", '"line\nbreak"']),
])
def test_dtype_regexes_and_parsers_agree(dtype, good, bad):
    for text in good:
        assert re.fullmatch(DTYPE_REGEX[dtype], text), text
        parse_dtype(dtype, text)
    for text in bad:
        assert not re.fullmatch(DTYPE_REGEX[dtype], text), text
    assert parse_dtype(int, "-12") == -12 and parse_dtype(bool, "False") is False
    assert parse_dtype(str, '"hi"') == "hi" and parse_dtype(float, "2.5") == 2.5


SCORES = [ChoiceScores([-1.0, -3.0], [-2.0, -2.5]),  # mean -2.0, gain mean 0.25
          ChoiceScores([-1.5], [-4.0]),  # mean -1.5, gain 2.5
          ChoiceScores([-1.0, -0.5, -6.0], [-1.0, -1.0, -1.0])]  # mean -2.5, gain -1.5


def test_token_length_normalized_picks_the_best_mean_logprob():
    decision = sgl.token_length_normalized(["a", "b", "c"], SCORES)
    assert decision.decision == "b"
    assert decision.meta_info["normalized_prompt_logprobs"] == [-2.0, -1.5, -2.5]


def test_greedy_token_selection_compares_token_by_token_with_mean_padding():
    # Column 0: a and c tie at -1.0 (b has -1.5); column 1: a -3.0 vs c -0.5, so c wins despite its worse mean.
    decision = sgl.greedy_token_selection(["a", "b", "c"], SCORES)
    assert decision.decision == "c"
    assert decision.meta_info["padded_token_logprobs"][0] == [-1.0, -3.0, -2.0]


def test_unconditional_likelihood_normalized_uses_the_gain_over_no_context():
    decision = sgl.unconditional_likelihood_normalized(["a", "b", "c"], SCORES)
    assert decision.decision == "b"
    assert decision.meta_info["unconditional_gains"] == pytest.approx([0.25, 2.5, -1.5])
    with pytest.raises(ValueError, match="unconditional"):
        sgl.unconditional_likelihood_normalized(["a"], [ChoiceScores([-1.0])])


def test_select_temperature_samples_in_proportion():
    import random

    rng = random.Random(0)
    picks = [sgl.token_length_normalized(["a", "b"], [ChoiceScores([math.log(0.25)]), ChoiceScores([math.log(0.75)])],
                                         temperature=1.0, rng=rng).decision for _ in range(2000)]
    assert 0.70 < picks.count("b") / len(picks) < 0.80


def test_tracing_finds_the_constant_prefix_and_stops_at_arguments():
    @sgl.function
    def program(s, question, style="short"):
        s += "You answer questions.\n"
        s += sgl.system("Be brief.")
        s += "Q: " + question + "\n"
        s += sgl.gen("answer")

    trace = program.trace()
    prefix = constant_prefix(trace.nodes)
    assert [type(n) for n in prefix] == [Constant, RoleBegin, Constant, RoleEnd, Constant]
    assert any(isinstance(n, Argument) for c in trace.nodes if isinstance(c, Concat) for n in c.parts)


def test_tracing_stops_at_a_variable_read_and_an_f_string():
    @sgl.function
    def reads(s):
        s += "head " + sgl.gen("x")
        s += s["x"]

    @sgl.function
    def formats(s, name):
        s += "head"
        s += f"Hello {name}"

    assert "variable 'x'" in reads.trace().stopped_by
    trace = formats.trace()
    assert [n.text for n in trace.nodes] == ["head"] and "argument 'name'" in trace.stopped_by


def test_program_arguments_bind_and_mismatch():
    @sgl.function
    def program(s, a, b=2):
        pass

    assert program.program.arguments((1,), {}) == {"a": 1}
    assert program.bind(b=5).program.arguments((), {"a": 1}) == {"a": 1, "b": 5}
    with pytest.raises(TypeError, match="program"):
        program.program.arguments((), {})
    with pytest.raises(TypeError, match="no parameter"):
        program.bind(c=1)
    with pytest.raises(TypeError, match="first parameter is the state"):
        sgl.function(lambda: None)


def test_sglangs_num_api_spec_tokens_is_accepted_and_changes_nothing():
    """Programs written for SGLang pass it; the program is the one plain `@function` makes."""
    @sgl.function(num_api_spec_tokens=64)
    def program(s, a):
        s += a

    assert program.program == sgl.function(program.program.func).program

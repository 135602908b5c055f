"""The language as data (no torch, no I/O, no threads): expressions, choice methods, dtypes, programs, tracing."""

from .api import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    image,
    role,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from .choices import (
    ChoiceScores,
    ChoicesDecision,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from .ir import Expr
from .program import Program
from .tracing import Trace, constant_prefix, trace

__all__ = [
    "ChoiceScores", "ChoicesDecision", "Expr", "Program", "Trace", "assistant", "assistant_begin", "assistant_end",
    "constant_prefix", "gen", "gen_int", "gen_string", "greedy_token_selection", "image", "role", "select",
    "separate_reasoning", "system", "system_begin", "system_end", "token_length_normalized", "trace",
    "unconditional_likelihood_normalized",
    "user", "user_begin", "user_end", "video",
]

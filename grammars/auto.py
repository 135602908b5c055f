"""grammar_backend="auto": for each spec, the first backend in a per-kind order that enforces it exactly.

Each kind asks its backends, fastest first, how faithful the spec's grammar would be (xgrammar knows before its slow
compile against the vocabulary) and compiles the first exact one. When none is exact it compiles the fastest
backend's approximation; the grammar queue refuses that one unless the request set allow_approximate_schema. A spec
no backend converts fails with every backend's reason.

The order, measured on this machine (2 cores; one compile at a time, then a mask fill per token along a valid
instance; the default model's 49,152-token vocabulary):
- json_schema, on the 375 jsonschemabench-dev schemas: llguidance compiles in 0.8 ms p50 / 22 ms p99 and fills a
  mask in 23 us on average; xgrammar compiles in 111 ms p50 / 11 s p99 (JSON Schema's open objects make its grammars
  large) and fills in 9 us. xgrammar's faster masks repay its compile only after ~8,000 tokens of one cached schema,
  so llguidance goes first. It is also the one more often exact (265 schemas against xgrammar's 241).
- regex and choices: llguidance first, though xgrammar compiles a regex in 0.4-0.7 ms (llguidance 0.9-1.0 ms) and
  fills in 2-7 us (llguidance 17-100 us), because both costs are small beside a forward step (tens of ms here) and
  where the grammar forces text llguidance's mask admits only the tokenizer's own encoding of it, while xgrammar's
  admits every split. So under llguidance jump-forward (which appends that encoding) gives what greedy decoding
  without it gives; under xgrammar the default model was seen to write ` ` `Con` `f` `idence` where jump-forward
  appends ` Confidence` (tests/test_jump_forward_retokenize.py).
- ebnf: xgrammar first (its own dialect); llguidance's faithful translation fills ~1.3 ms per token
  (ebnf_to_lark.py).
- outlines-core is left out: it compiles slowest (100 ms p50, tens of seconds for some schemas, in a child process)
  and on the dev set enforced exactly no schema that both others could not.
"""

from __future__ import annotations

from .base import CompiledGrammar, GrammarPlan, GrammarSpec, PlanningBackend

ORDER = {
    "json_schema": ("llguidance", "xgrammar"),
    "regex": ("llguidance", "xgrammar"),
    "choices": ("llguidance", "xgrammar"),
    "ebnf": ("xgrammar", "llguidance"),
}
BACKENDS = tuple(dict.fromkeys(name for names in ORDER.values() for name in names))


class AutoBackend:
    name = "auto"

    def __init__(self, backends: dict[str, PlanningBackend]) -> None:
        self.backends = backends

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        plans: list[GrammarPlan] = []
        failures: list[str] = []
        for name in ORDER[spec.kind]:
            try:
                plan = self.backends[name].plan(spec)
            except ValueError as error:
                failures.append(f"{name}: {error}")
                continue
            if plan.fidelity.exact:
                return plan.compile()
            plans.append(plan)
        if not plans:
            raise ValueError(f"{spec.kind} does not compile with any grammar backend ({'; '.join(failures)})")
        # The fastest backend's approximation: the one a request that allows approximation gets.
        return plans[0].compile()


def approximation_refused(spec: GrammarSpec, compiled: CompiledGrammar) -> str:
    """Why an auto request fails when no backend enforces its spec exactly, naming what the grammar auto would use
    leaves out."""
    return (f"{spec.kind} cannot be enforced exactly by any grammar backend; {compiled.fidelity.backend} would "
            f"approximate it: {'; '.join(compiled.fidelity.approximations)}. Set allow_approximate_schema=true to "
            "accept this approximation, or choose a grammar_backend explicitly.")

"""The plug-ins one scheduler runs, built in the order the loop calls them: a disaggregation side first (a prefill
server cuts every request to its first token before it queues), the grammar queue, the speculator (with
speculative_algorithm), generation control and weight sync; and the control calls they and the scheduler answer."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoTokenizer

from ...grammars.cache import GrammarCache
from ...grammars.registry import make_backend
from .. import registry
from ..executor.model_runner import ModelRunner
from .plugins.base import SchedulerHandle, SchedulerPlugin
from .plugins.generation_control import GenerationControl
from .plugins.grammar_queue import GrammarQueue
from .plugins.rpc import Handler, SchedulerRpc
from .plugins.speculation import Speculator
from .plugins.weight_sync import WeightSync


@dataclass
class Plugins:
    """Every plug-in in the loop's order, and those the scheduler itself talks to: the grammar queue (masks), weight
    sync (the weight version on outputs) and the speculator (its verify step runs the launcher's drafted batches)."""

    ordered: list[SchedulerPlugin]
    grammars: GrammarQueue
    weights: WeightSync
    speculator: Speculator | None


def build_plugins(scheduler: SchedulerHandle, tokenizer_path: str, eos_ids: frozenset[int]) -> Plugins:
    args = scheduler.args
    grammars = GrammarQueue(scheduler, grammar_cache(scheduler.args, scheduler.runner, tokenizer_path, eos_ids),
                            args.grammar_compile_timeout)
    speculator = Speculator(args, scheduler.runner) if args.speculative_algorithm else None
    weights = WeightSync(scheduler)
    ordered = [*disaggregation_side(scheduler), grammars, *([speculator] if speculator else []),
               GenerationControl(scheduler), weights]
    return Plugins(ordered, grammars, weights, speculator)


def grammar_cache(args, runner: ModelRunner, tokenizer_path: str, eos_ids: frozenset[int]) -> GrammarCache | None:
    """The grammar backend builds on the cache's pool while the engine already serves, from a tokenizer of its
    own: a fast tokenizer may refuse a call from a second thread while the loop is encoding with it."""
    if args.grammar_backend == "none":
        return None
    return GrammarCache.building(lambda: make_backend(args.grammar_backend, AutoTokenizer.from_pretrained(
        tokenizer_path), runner.vocab_size, sorted(eos_ids), args.grammar_compile_timeout))


def disaggregation_side(scheduler: SchedulerHandle) -> list[SchedulerPlugin]:
    """The plug-in of a prefill or decode server (registered with its implementation); none serving whole."""
    mode = scheduler.args.disaggregation_mode
    return [] if mode == "null" else [registry.resolve("disaggregation_mode", mode)(scheduler)]


def control_calls(own: dict[type, Handler], plugins: list[SchedulerPlugin]) -> SchedulerRpc:
    """The scheduler's own control calls and every plug-in's, each answered by its type."""
    return SchedulerRpc(own | {kind: handler for plugin in plugins for kind, handler in plugin.rpc_handlers().items()})

"""What a program's function receives as `s`: add expressions, read variables, fork, stream text."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from typing import Any

from ..lang.building import BuildingMethods
from ..lang.ir import CommitPrefix, Expr, SetVar, as_expr
from .errors import ProgramError
from .events import TextEvent
from .executor import Executor
from .typed import parse_value

JOIN_MODES = ("gather_variable", "concate_and_append")


class ProgramState(BuildingMethods):
    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.ret_value: Any = None
        # The streaming async run's program task, held here so it is not garbage-collected while it runs.
        self.body_task: asyncio.Future | None = None

    def _add(self, expr: Expr) -> None:
        self.executor.submit(expr)

    # -- building ---------------------------------------------------------------------------------------------

    def __iadd__(self, other: Any) -> ProgramState:
        if other is None:
            raise ValueError("cannot add None to a program state")
        self._add(as_expr(other))
        return self

    def fork(self, size: int = 1) -> ProgramStateGroup:
        """`size` copies of this state as it is now; with more than one, the shared text is cached first."""
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 4096:
            raise ValueError(f"fork size must be an integer in [1, 4096], got {size!r}")
        if size > 1:
            self.executor.submit(CommitPrefix())
        self.sync()
        return ProgramStateGroup([ProgramState(self.executor.child()) for _ in range(size)], self)

    @contextlib.contextmanager
    def copy(self) -> Iterator[ProgramState]:
        """`with s.copy() as c:` a one-child fork whose new variables are gathered back at the end."""
        group = self.fork(1)
        yield group[0]
        group.join()

    # -- reading ----------------------------------------------------------------------------------------------

    def __getitem__(self, name: str | None) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str | None) -> bool:
        self.sync()
        return name in self.executor.variables

    def get_var(self, name: str | None) -> Any:
        """The variable's value, once the node that sets it has run; a failed node raises its ProgramError."""
        if self.executor.future_of(name) is None:
            self.executor.wait_for_body()
        self.executor.wait(self.executor.future_of(name) or self.executor.last_future() or _done())
        return self._lookup(name)

    def set_var(self, name: str, value: Any) -> None:
        self.executor.submit(SetVar(name, value))

    def get(self, name: str | None, type: Any = None) -> Any:  # noqa: A002 - mirrors dict.get's feel
        """The variable parsed into `type`, or into what its gen declared (dtype, json_schema); raw otherwise."""
        value = self.get_var(name)
        return parse_value(value, type if type is not None else self.executor.output_types.get(name))

    async def aget(self, name: str | None, type: Any = None) -> Any:  # noqa: A002 - get()'s SGLang-compatible name
        """Async twin of get(): awaits without blocking the caller's event loop."""
        if self.executor.future_of(name) is None:
            await asyncio.to_thread(self.executor.wait_for_body)
        await asyncio.wrap_future(self.executor.future_of(name) or self.executor.last_future() or _done())
        value = self._lookup(name)
        return parse_value(value, type if type is not None else self.executor.output_types.get(name))

    def get_meta_info(self, name: str | None) -> Any:
        self.get_var(name)
        return self.executor.meta_info.get(name)

    def _lookup(self, name: str | None) -> Any:
        if name not in self.executor.variables:
            if self.executor.error is not None:
                raise self.executor.error
            known = sorted(str(k) for k in self.executor.variables)
            raise KeyError(f"no variable {name!r} in this state (it has: {', '.join(known) or 'none'})")
        return self.executor.variables[name]

    def sync(self) -> None:
        """Wait for every node the program adds (all of them, once a streaming run's function has returned);
        raises the ProgramError of the first one that failed."""
        self.executor.wait_for_body()
        last = self.executor.last_future()
        if last is not None:
            self.executor.wait(last)

    async def async_sync(self) -> None:
        if not self.executor.body_returned.is_set():
            await asyncio.to_thread(self.executor.wait_for_body)
        last = self.executor.last_future()
        if last is not None:
            await asyncio.wrap_future(last)

    def error(self) -> ProgramError | None:
        """The failure that stopped this state, or None (waits for what was added first)."""
        with contextlib.suppress(ProgramError):
            self.sync()
        return self.executor.error

    def text(self) -> str:
        self.sync()
        return self.executor.text

    def messages(self) -> list[dict[str, Any]]:
        """The roles added so far as a message list: each content a string, or where the model's chat template
        shows images (or reads text only from parts), HF's content parts (`{"type": "image", "image": source}`,
        `{"type": "text", "text": ...}`), as `processor.apply_chat_template` takes them."""
        self.sync()
        return [{**m, "content": list(m["content"]) if isinstance(m["content"], list) else m["content"]}
                for m in self.executor.messages]

    # -- streaming --------------------------------------------------------------------------------------------

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is produced (of one variable when `var_name` is given), until the program ends."""
        index = 0
        while True:
            self.executor.wait(self.executor.log.wait_beyond(index))
            events, finished = self._new_events(index, var_name)
            index += len(events)
            for event in events:
                if _wanted(event, var_name):
                    yield event.text
            if finished:
                return

    async def text_async_iter(self, var_name: str | None = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        """Async twin of text_iter(); with return_meta_data yields (text, meta_info) pairs."""
        index = 0
        while True:
            await asyncio.wrap_future(self.executor.log.wait_beyond(index))
            events, finished = self._new_events(index, var_name)
            index += len(events)
            for event in events:
                if _wanted(event, var_name):
                    yield (event.text, event.meta_info) if return_meta_data else event.text
            if finished:
                return

    def _new_events(self, index: int, var_name: str | None) -> tuple[list[TextEvent], bool]:
        log = self.executor.log
        events = log.events[index:]
        var_done = var_name is not None and any(e.done and e.var == var_name for e in events)
        if log.closed and len(log.events) == index + len(events) and log.error is not None and not var_done:
            raise log.error
        return events, var_done or (log.closed and len(log.events) == index + len(events))

    def __repr__(self) -> str:
        # No waiting here: a debugger or a log line must not block on (or raise from) pending nodes.
        return f"ProgramState({self.executor.text!r})"


class ProgramStateGroup:
    """The children of a fork: `+=` adds to every child (one expression, `lambda i: expr`, or a list)."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __getitem__(self, index: int) -> ProgramState:
        return self.states[index]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if callable(other) and not isinstance(other, Expr):
            for index, state in enumerate(self.states):
                state += other(index)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} expressions for {len(self.states)} forked states")
            for state, expr in zip(self.states, other):
                state += expr
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: each variable the children added becomes a list on the parent (nested forks nest
        lists); concate_and_append: the children's new text is appended to the parent's."""
        if mode not in JOIN_MODES:
            raise ValueError(f"join mode must be one of {JOIN_MODES}, got {mode!r}")
        for state in self.states:
            state.sync()
        if mode == "gather_variable":
            self._gather()
        else:
            text = "".join(s.executor.text[s.executor.fork_start:] for s in self.states)
            self.parent += text
        for state in self.states:
            state.executor.end()

    def _gather(self) -> None:
        self.parent.sync()
        known = set(self.parent.executor.variables)
        gathered: dict[Any, list] = {}
        for state in self.states:
            for name, value in state.executor.variables.items():
                if name not in known:
                    gathered.setdefault(name, []).append(value)
        for name, values in gathered.items():
            self.parent.executor.submit(SetVar(name, values))


def _wanted(event: TextEvent, var_name: str | None) -> bool:
    return bool(event.text) and (var_name is None or event.var == var_name)


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future

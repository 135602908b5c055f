"""`@function`: run a program once, in a batch, asynchronously, or streaming; bind, trace and pre-cache it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import tqdm

from ..lang.program import Program
from ..lang.tracing import Trace, constant_prefix, trace
from ..runtime.sampling.params import declared_default
from .backends.base import Backend
from .backends.resolve import resolve_backend
from .errors import ProgramError
from .executor import RUNNING_BODY, Executor
from .loop import run_coroutine
from .state import ProgramState

RUN_SAMPLING_FIELDS = ("max_new_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
                       "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos")
# run()'s sampling defaults are the runtime's, which are SGLang's frontend's (note: temperature 1.0, so gen samples
# by default); None leaves a field out.
SAMPLING_DEFAULTS: dict[str, Any] = {name: declared_default(name) for name in RUN_SAMPLING_FIELDS}
LOGPROB_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
# A traced prefix shorter than this is not worth a request of its own (SGLang uses the same bound).
MIN_PRECACHE_CHARS = 64


@dataclass
class RunOptions:
    sampling: dict[str, Any] = field(default_factory=dict)
    logprobs: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    backend: Any = None

    @classmethod
    def pop_from(cls, kwargs: dict[str, Any]) -> RunOptions:
        """Take run()'s own keywords out of `kwargs`, leaving the program's arguments."""
        sampling = {k: kwargs.pop(k, v) for k, v in SAMPLING_DEFAULTS.items()}
        logprobs = {k: kwargs.pop(k) for k in LOGPROB_KEYS if k in kwargs}
        stream = kwargs.pop("stream", False)
        if not isinstance(stream, bool):
            raise ValueError(f"stream must be True or False, got {stream!r}")
        return cls({k: v for k, v in sampling.items() if v is not None},
                   {k: v for k, v in logprobs.items() if v is not None}, stream, kwargs.pop("backend", None))


class Function:
    """A decorated program. Calling it is run()."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.__name__ = program.name
        self.__doc__ = getattr(program.func, "__doc__", None)

    def __repr__(self) -> str:
        return f"<furcate function {self.program.name}>"

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def bind(self, **kwargs: Any) -> Function:
        """A copy with some program arguments fixed."""
        return Function(self.program.bind(**kwargs))

    # -- one program ------------------------------------------------------------------------------------------

    def run(self, *args: Any, **kwargs: Any) -> ProgramState:
        """Run the program; returns its state once every node ran (at once with stream=True).

        Keywords: the sampling defaults (max_new_tokens=128, temperature=1.0, stop, ... as SGLang), logprob
        options, stream, backend; the rest are the program's arguments. A failed node raises ProgramError.
        """
        options = RunOptions.pop_from(kwargs)
        arguments = self.program.arguments(args, kwargs)
        backend = resolve_backend(options.backend)
        if self.program.is_async:
            _refuse_inside_loop("run", "arun")
            return asyncio.run(self._arun(arguments, options, backend))
        state = self._new_state(backend, options)
        if options.stream:
            state.executor.body_returned.clear()
            threading.Thread(target=self._body_quietly, args=(state, arguments), daemon=True,
                             name=f"furcate-{self.program.name}").start()
            return state
        self._body(state, arguments)
        state.sync()
        return state

    async def arun(self, *args: Any, **kwargs: Any) -> ProgramState:
        """Async run(): an `async def` program runs on the caller's loop, a plain one on a worker thread."""
        options = RunOptions.pop_from(kwargs)
        arguments = self.program.arguments(args, kwargs)
        return await self._arun(arguments, options, resolve_backend(options.backend))

    async def _arun(self, arguments: dict[str, Any], options: RunOptions, backend: Backend) -> ProgramState:
        state = self._new_state(backend, options)
        if options.stream:
            state.executor.body_returned.clear()
            state.body_task = asyncio.ensure_future(self._abody(state, arguments, quiet=True))
            return state
        await self._abody(state, arguments, quiet=False)
        await state.async_sync()
        return state

    def _new_state(self, backend: Backend, options: RunOptions) -> ProgramState:
        return ProgramState(Executor(backend, options.sampling, options.logprobs, options.stream))

    def _body(self, state: ProgramState, arguments: dict[str, Any]) -> None:
        token = RUNNING_BODY.set(state.executor)
        try:
            state.ret_value = self.program.func(state, **arguments)
        except BaseException as error:
            state.executor.fail_body(error, self.program.name)
            raise
        finally:
            RUNNING_BODY.reset(token)
            state.executor.end()
            state.executor.body_returned.set()

    def _body_quietly(self, state: ProgramState, arguments: dict[str, Any]) -> None:
        try:
            self._body(state, arguments)
        except Exception:  # noqa: BLE001 - recorded on the state; its reads and streams raise it
            pass

    async def _abody(self, state: ProgramState, arguments: dict[str, Any], quiet: bool) -> None:
        token = RUNNING_BODY.set(state.executor)
        try:
            if self.program.is_async:
                state.ret_value = await self.program.func(state, **arguments)
            else:
                state.ret_value = await asyncio.to_thread(self.program.func, state, **arguments)
        except Exception as error:
            state.executor.fail_body(error, self.program.name)
            if not quiet:
                raise
        finally:
            RUNNING_BODY.reset(token)
            state.executor.end()
            state.executor.body_returned.set()

    # -- many programs ----------------------------------------------------------------------------------------

    def run_batch(self, batch_kwargs: list[dict[str, Any] | tuple], *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, generator_style: bool = False,
                  **sampling: Any) -> list[ProgramState] | Iterator[ProgramState]:
        """Run the program once per argument set (a dict of keywords or a tuple of positionals), concurrently.

        Returns the states in input order (an iterator of them with generator_style). A program that fails does
        not stop the others: its state raises ProgramError where it is read.
        """
        rest = dict(sampling, backend=backend)
        options = RunOptions.pop_from(rest)
        if rest:
            raise TypeError(f"run_batch() got unexpected keyword(s): {', '.join(sorted(rest))}")
        backend_obj = resolve_backend(options.backend)
        calls = [self._bind_item(item) for item in _check_batch(batch_kwargs)]
        if self.program.is_async:
            _refuse_inside_loop("run_batch", "arun_batch")
            states = asyncio.run(self._arun_batch(calls, options, backend_obj, progress_bar))
            return iter(states) if generator_style else states
        self._precache(backend_obj, len(calls))
        threads = _thread_count(num_threads, len(calls))
        states = self._run_threads(calls, options, backend_obj, threads, progress_bar)
        return states if generator_style else list(states)

    async def arun_batch(self, batch_kwargs: list[dict[str, Any] | tuple], *, backend: Any = None,
                         progress_bar: bool = False, **sampling: Any) -> list[ProgramState]:
        """Async run_batch(): `async def` programs run as tasks on the caller's loop, with no thread each."""
        rest = dict(sampling, backend=backend)
        options = RunOptions.pop_from(rest)
        if rest:
            raise TypeError(f"arun_batch() got unexpected keyword(s): {', '.join(sorted(rest))}")
        calls = [self._bind_item(item) for item in _check_batch(batch_kwargs)]
        return await self._arun_batch(calls, options, resolve_backend(options.backend), progress_bar)

    async def _arun_batch(self, calls: list[dict[str, Any]], options: RunOptions, backend: Backend,
                          progress_bar: bool) -> list[ProgramState]:
        if len(calls) > 1:
            await asyncio.to_thread(self._precache, backend, len(calls))
        bar = tqdm.tqdm(total=len(calls), disable=not progress_bar)

        async def one(arguments: dict[str, Any]) -> ProgramState:
            state = self._new_state(backend, options)
            await self._abody(state, arguments, quiet=True)
            with _suppress_program_error():
                await state.async_sync()
            bar.update()
            return state

        try:
            return list(await asyncio.gather(*(one(arguments) for arguments in calls)))
        finally:
            bar.close()

    def _run_threads(self, calls: list[dict[str, Any]], options: RunOptions, backend: Backend, threads: int,
                     progress_bar: bool) -> Iterator[ProgramState]:
        def one(arguments: dict[str, Any]) -> ProgramState:
            state = self._new_state(backend, options)
            self._body_quietly(state, arguments)
            with _suppress_program_error():
                state.sync()
            return state

        with ThreadPoolExecutor(threads, thread_name_prefix=f"furcate-{self.program.name}") as pool, \
                tqdm.tqdm(total=len(calls), disable=not progress_bar) as bar:
            futures = [pool.submit(one, arguments) for arguments in calls]
            for future in futures:
                future.add_done_callback(lambda _: bar.update())
            for future in futures:
                yield future.result()

    def _bind_item(self, item: dict[str, Any] | tuple) -> dict[str, Any]:
        if isinstance(item, dict):
            return self.program.arguments((), item)
        if isinstance(item, (tuple, list)):
            return self.program.arguments(tuple(item), {})
        raise TypeError(f"run_batch takes a list of dicts (keywords) or tuples (positionals), got {item!r}")

    # -- tracing ----------------------------------------------------------------------------------------------

    def trace(self) -> Trace:
        """The nodes the program adds before it needs an argument's value or a generated variable."""
        return trace(self.program)

    def cache(self, backend: Any = None) -> str:
        """Send the program's constant prefix to the backend's cache; returns that prefix text."""
        return self._precache(resolve_backend(backend), 2, min_chars=1)

    def _precache(self, backend: Backend, batch_size: int, min_chars: int = MIN_PRECACHE_CHARS) -> str:
        nodes = constant_prefix(self.trace().nodes)
        if batch_size < 2 or not nodes:
            return ""
        executor = Executor(backend, {}, {}, stream=False)
        for node in nodes:
            executor.submit(node)
        executor.wait(executor.last_future())
        if len(executor.text) >= min_chars:
            run_coroutine(backend.cache_prefix(executor.text)).result()
            return executor.text
        return ""


def function(func: Callable | None = None, num_api_spec_tokens: int | None = None):
    """Decorate a program: `@function` or `@function(num_api_spec_tokens=...)`; its first parameter is `s`."""
    # Accepted and ignored: programs written for SGLang pass it (its API-model speculative execution), and they
    # should run unchanged; no backend here speculates for an API model, so the value means nothing.
    del num_api_spec_tokens
    if func is None:
        return lambda f: Function(Program(f))
    return Function(Program(func))


def _check_batch(batch: Any) -> list:
    if not isinstance(batch, (list, tuple)):
        raise TypeError(f"run_batch takes a list of argument sets, got {type(batch).__name__}")
    return list(batch)


def _thread_count(num_threads: int | str, batch_size: int) -> int:
    if num_threads == "auto":
        # Program threads mostly wait on the interpreter loop, so many are cheap; the bound keeps memory sane.
        return max(1, min(batch_size, 256))
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive integer or 'auto', got {num_threads!r}")
    return max(1, min(num_threads, batch_size))


def _refuse_inside_loop(name: str, async_name: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{name}() of an async program inside a running event loop; use `await fn.{async_name}()`")


def _suppress_program_error() -> contextlib.AbstractContextManager:
    """Batch members keep their failure on their state (raised at its reads) instead of stopping the batch."""
    return contextlib.suppress(ProgramError)

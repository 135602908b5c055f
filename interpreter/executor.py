"""Runs one program state's nodes in order, as a task on the interpreter loop; one handler per node kind.

The program's thread only submits nodes (`s += ...` returns at once) and waits where it reads; the first
failing node is recorded as a ProgramError, every later node is skipped, and every read re-raises it.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any

from ..lang.choices import ChoicesDecision
from ..lang.ir import (
    CommitPrefix,
    Concat,
    Constant,
    Expr,
    Gen,
    Image,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    SetVar,
    VarRef,
    VarScopeBegin,
    VarScopeEnd,
    Video,
    defined_names,
)
from ..runtime.tools.reasoning import reasoning_format, split
from .backends.base import Backend
from .errors import ProgramError
from .events import EventLog, TextEvent
from .image_markers import ImageMarkers
from .loop import call_soon, on_interpreter_loop
from .open_role import OpenRole, ShownImage

# The executor whose program function is running in this context (its reads must not wait for it to return).
RUNNING_BODY: contextvars.ContextVar[Executor | None] = contextvars.ContextVar("furcate_running_body",
                                                                                  default=None)


class EndOfProgram(Expr):
    """Submitted after the program's function returns: closes the stream of text."""

    def describe(self) -> str:
        return "end of program"


class Executor:
    def __init__(self, backend: Backend, sampling: dict[str, Any], logprobs: dict[str, Any], stream: bool) -> None:
        self.backend = backend
        self.sampling = sampling  # run()'s defaults, in the runtime's names
        self.logprobs = logprobs
        self.stream = stream
        self.text = ""
        self.variables: dict[str | None, Any] = {}
        self.meta_info: dict[str | None, Any] = {}
        self.output_types: dict[str | None, Any] = {}
        self.messages: list[dict[str, Any]] = []
        self.images: list[Any] = []  # the images self.text shows, in the order of their placeholders
        self.open_role: OpenRole | None = None
        self.fork_start = 0
        self.scopes: dict[str, int] = {}
        self.error: ProgramError | None = None
        self.log = EventLog()
        self._queue: deque[tuple[Expr, Future]] = deque()
        self._draining = False
        self._pending: dict[str | None, Future] = {}
        self._last: Future | None = None
        self._lock = threading.Lock()
        # Cleared while the program's function runs on another thread (stream=True): a read of a variable
        # that no node has set yet waits for the function to return before deciding the variable is missing.
        self.body_returned = threading.Event()
        self.body_returned.set()

    # -- the program's side ---------------------------------------------------------------------------------

    def wait_for_body(self) -> None:
        """Called before deciding a variable no node sets is missing: the program may still add that node."""
        if RUNNING_BODY.get() is not self:
            self.body_returned.wait()

    def submit(self, expr: Expr) -> Future:
        future: Future = Future()
        with self._lock:  # the loop must see nodes in the order their futures were registered
            for name in defined_names(expr):
                self._pending[name] = future
            self._last = future
            call_soon(self._enqueue, expr, future)
        return future

    def last_future(self) -> Future | None:
        return self._last

    def future_of(self, name: str | None) -> Future | None:
        """The pending node that sets `name` last, if any: a read waits for it."""
        return self._pending.get(name)

    def fail_body(self, error: BaseException, program: str) -> None:
        """The program's own code raised: record it like a failed node so reads and streams see it."""
        if self.error is None:
            self.error = ProgramError(f"program {program}", error)
            self.log.close(self.error)

    def end(self) -> None:
        self.submit(EndOfProgram())

    def child(self) -> Executor:
        """A fork child: a copy of this state as it is now (call after sync)."""
        child = Executor(self.backend, self.sampling, self.logprobs, self.stream)
        child.text = self.text
        child.variables = dict(self.variables)
        child.meta_info = dict(self.meta_info)
        child.output_types = dict(self.output_types)
        child.messages = list(self.messages)
        child.images = list(self.images)
        child.open_role = self.open_role.copy() if self.open_role is not None else None
        child.fork_start = len(self.text)
        return child

    @staticmethod
    def wait(future: Future) -> None:
        if on_interpreter_loop():
            raise RuntimeError("a blocking read of a program state on the interpreter's own loop; in an async "
                               "program use `await state.aget(name)` or `await state.async_sync()`")
        future.result()

    # -- the loop's side ------------------------------------------------------------------------------------

    def _enqueue(self, expr: Expr, future: Future) -> None:
        self._queue.append((expr, future))
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            while self._queue:
                expr, future = self._queue.popleft()
                if self.error is None:
                    try:
                        await self._execute(expr)
                    except ProgramError as error:
                        self._fail(error)
                if self.error is None:
                    future.set_result(None)
                else:
                    future.set_exception(self.error)
        finally:
            self._draining = False

    def _fail(self, error: ProgramError) -> None:
        self.error = error
        self.log.close(error)

    async def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Concat):
            for part in expr.parts:
                await self._execute(part)
            return
        handler = HANDLERS.get(type(expr))
        try:
            if handler is None:
                raise TypeError(f"cannot run a {type(expr).__name__} node")
            await handler(self, expr)
        except Exception as error:  # every failure becomes the node's ProgramError
            raise ProgramError(expr.describe(), error) from error

    def _append(self, text: str, var: str | None = None, meta_info: dict | None = None) -> None:
        if text:
            self._write_held()
        self.text += text
        if text:
            self.log.append(TextEvent(text, var, meta_info))

    def _write_held(self) -> None:
        """Write the whitespace the open role's prefix holds back: what comes next is not a generation."""
        role = self.open_role
        if role is not None and role.held:
            held, role.held = role.held, ""
            self._append(held)
            role.begin = len(self.text)

    def _set_var(self, name: str | None, value: Any, meta_info: Any = None, output_type: Any = None) -> None:
        self.variables[name] = value
        self.meta_info[name] = meta_info
        self.output_types[name] = output_type
        self.log.append(TextEvent("", name, meta_info, done=True))

    # -- one handler per node kind --------------------------------------------------------------------------

    async def _constant(self, expr: Constant) -> None:
        self._append(expr.text)

    async def _gen(self, expr: Gen) -> None:
        if self.open_role is not None:  # the prompt ends as the template's generation prompt does
            self.open_role.left_to_model, self.open_role.held = self.open_role.held, ""
        sampling = {**self.sampling, **expr.sampling}
        if expr.constraint is not None:  # built once by gen(); a backend that talks HTTP flattens it (wire_sampling)
            sampling["grammar"] = expr.constraint
        logprobs = {**self.logprobs, **expr.logprobs}
        if self.stream and sampling.get("n", 1) == 1:
            await self._gen_streaming(expr, sampling, logprobs)
            return
        result = await self.backend.generate(self.text, sampling, images=self.images, **logprobs)
        if isinstance(result, list):  # n > 1: the variable holds every sample; the text continues with the first
            self._append(result[0]["text"], expr.name)
            self._set_var(expr.name, [r["text"] for r in result], [r["meta_info"] for r in result],
                          expr.output_type)
        else:
            self._append(result["text"], expr.name, result["meta_info"])
            self._set_var(expr.name, result["text"], result["meta_info"], expr.output_type)

    async def _gen_streaming(self, expr: Gen, sampling: dict[str, Any], logprobs: dict[str, Any]) -> None:
        prompt, start, meta_info = self.text, len(self.text), None
        async for chunk in self.backend.generate_stream(prompt, sampling, images=list(self.images), **logprobs):
            sent = self.text[start:]
            meta_info = chunk["meta_info"]
            if chunk["text"].startswith(sent):
                self._append(chunk["text"][len(sent):], expr.name, meta_info)
            else:  # the final text was trimmed (a stop regex matched across what was already streamed)
                self.text = prompt + chunk["text"]
        self._set_var(expr.name, self.text[start:], meta_info, expr.output_type)

    async def _select(self, expr: Select) -> None:
        method = expr.choices_method
        choices = list(expr.choices)
        self._write_held()
        scores = await self.backend.score_choices(self.text, choices, method.requires_unconditional,
                                                  images=self.images)
        decision: ChoicesDecision = method(choices, scores, expr.temperature)
        self._append(decision.decision, expr.name, decision.meta_info)
        self._set_var(expr.name, decision.decision, decision.meta_info)

    async def _separate_reasoning(self, expr: SeparateReasoning) -> None:
        fmt = reasoning_format(expr.model_type)
        begins = fmt.in_reasoning(fmt.opened_by(self.text))
        await self._execute(expr.expr)
        name = expr.expr.name
        reasoning, content = split(fmt, self.variables[name], begins)
        self.variables[name] = content
        self.variables[f"{name}_reasoning_content"] = reasoning

    async def _role_begin(self, expr: RoleBegin) -> None:
        if self.open_role is not None:
            raise ValueError(f"the {expr.role} role begins inside the {self.open_role.role} role; roles do not nest")
        template = self.backend.chat_template()
        if not self.messages and expr.role != "system":
            default_system = template.default_system_prompt()
            if default_system:  # the template would insert it; keep text and messages() in step
                markers = template.markers("system")
                self._append(markers.first_prefix + default_system + markers.suffix)
                self.messages.append(template.message("system", default_system))
        previous = self.messages[-1]["role"] if self.messages else None
        prefix = template.markers(expr.role).prefix_after(previous)
        held = template.generation_tail(previous) if expr.role == "assistant" and previous is not None else ""
        self._append(prefix[: len(prefix) - len(held)])
        self.open_role = OpenRole(expr.role, len(self.text), held)

    async def _role_end(self, expr: RoleEnd) -> None:
        role = self.open_role
        if role is None or role.role != expr.role:
            raise ValueError(f"{expr.role}_end without a matching {expr.role}_begin (open role: "
                             f"{role and role.role})")
        self._write_held()
        message = self._message_of(role)
        self._append(self._closing_of(role))
        self.messages.append(message)
        self.open_role = None

    def _message_of(self, role: OpenRole) -> dict[str, Any]:
        """The role's message: content parts where it shows images as parts, else its text as the template reads
        text."""
        if role.images:
            return {"role": role.role, "content": role.parts(self.text)}
        return self.backend.chat_template().message(role.role, role.plain(self.text))

    def _closing_of(self, role: OpenRole) -> str:
        markers = self._image_markers(role) if role.ends_with_image(self.text) else None
        return markers.closing if markers is not None else self.backend.chat_template().markers(role.role).suffix

    async def _media(self, expr: Image | Video) -> None:
        placeholder = self.backend.image_placeholder if isinstance(expr, Image) else None
        if placeholder is None:
            raise ValueError(f"this backend ({type(self.backend).__name__}) serves a text-only model; it takes no "
                             f"{expr.describe()} input")
        role = self.open_role
        markers = self._image_markers(role) if role is not None else None
        if role is None or markers is None:  # outside roles, or a template for strings: the placeholder in place
            self._append(placeholder)
        else:
            self._show_in_role(role, markers, expr.source)
        self.images.append(expr.source)

    def _image_markers(self, role: OpenRole) -> ImageMarkers | None:
        return self.backend.chat_template().image_markers(role.role, self.backend.image_placeholder)

    def _show_in_role(self, role: OpenRole, markers: ImageMarkers, source: Any) -> None:
        """Append an image part as the chat template renders it, where the program put it."""
        self._write_held()
        if not markers.after_text and role.has_text(self.text):
            raise ValueError(f"this model's chat template shows the images of a {role.role!r} message before its "
                             f"text, so an image cannot follow text there: put sgl.image(...) first in the role")
        start = len(self.text)
        self._append(markers.text)
        role.images.append(ShownImage(start, len(self.text), source))

    async def _var_ref(self, expr: VarRef) -> None:
        if expr.name not in self.variables:
            raise KeyError(f"no variable {expr.name!r}")
        self._append(str(self.variables[expr.name]))

    async def _set(self, expr: SetVar) -> None:
        self._set_var(expr.name, expr.value)

    async def _scope_begin(self, expr: VarScopeBegin) -> None:
        self.scopes[expr.name] = len(self.text)

    async def _scope_end(self, expr: VarScopeEnd) -> None:
        self._set_var(expr.name, self.text[self.scopes.pop(expr.name):])

    async def _commit(self, expr: CommitPrefix) -> None:
        if self.text:
            await self.backend.cache_prefix(self.text)

    async def _end(self, expr: EndOfProgram) -> None:
        self.log.close()


HANDLERS = {
    Constant: Executor._constant, Gen: Executor._gen, Select: Executor._select, RoleBegin: Executor._role_begin,
    SeparateReasoning: Executor._separate_reasoning,
    RoleEnd: Executor._role_end, Image: Executor._media, Video: Executor._media, VarRef: Executor._var_ref,
    SetVar: Executor._set, VarScopeBegin: Executor._scope_begin, VarScopeEnd: Executor._scope_end,
    CommitPrefix: Executor._commit, EndOfProgram: Executor._end,
}

"""`Runtime`: a furcate server in a child process, and the endpoint that talks to it (SGLang's `sgl.Runtime`)."""

from __future__ import annotations

import atexit
from typing import Any, Self

from .endpoint import RuntimeEndpoint


class Runtime:
    """`Runtime(model_path="default", **engine_args)` starts `furcate serve` on a free local port and waits until
    it is ready; `.url` is its address, `.endpoint` the RuntimeEndpoint programs run on (pass the Runtime itself
    as a backend: it is unwrapped to its endpoint). `shutdown()` (or leaving a `with` block, or the interpreter
    exiting) stops the server.

    `host`, `port` (0: a free one) and `api_key` configure the server; `startup_timeout` bounds the wait for it.
    `dp_size=N` runs N replicas behind sglang-router (`furcate serve --dp-size`), routed by `router_policy`;
    `pd_disaggregation=True` runs prefill and decode servers behind it (`furcate serve --pd-disaggregation`).
    """

    def __init__(self, model_path: str = "default", *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, startup_timeout: float = 600.0, dp_size: int = 1,
                 router_policy: str = "cache_aware", pd_disaggregation: bool = False, **engine_args: Any) -> None:
        from ...runtime.server.server_process import ServerProcess

        extra = ("--dp-size", str(dp_size), "--router-policy", router_policy) if dp_size != 1 else ()
        extra += ("--pd-disaggregation",) if pd_disaggregation else ()
        self.server = ServerProcess(model_path, engine_args, host=host, port=port, api_key=api_key,
                                    extra_args=extra, startup_timeout=startup_timeout)
        self.url: str = self.server.url
        try:
            self.endpoint = RuntimeEndpoint(self.url, api_key=api_key)
        except BaseException:
            self.server.stop()
            raise
        # A server left running would outlive the program that started it.
        atexit.register(self.shutdown)

    @property
    def pid(self) -> int:
        return self.server.process.pid

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the server (SIGTERM, then a kill after `timeout` seconds); calling it again does nothing."""
        atexit.unregister(self.shutdown)
        self.endpoint.close()
        self.server.stop(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Runtime({self.url!r})"

"""The scheduler's own process, started with `python -m furcate.runtime.scheduler.process ADDRESS` (engine/launch.py).

A fresh interpreter (not multiprocessing's spawn) means user scripts need no `if __name__ == "__main__"` guard:
nothing of the caller's main module is re-imported here. The engine's listener hands over the arguments through
an authenticated connection that then carries every message both ways.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import traceback
from multiprocessing.connection import Client, Connection

from ..wire.process_start import AUTHKEY_ENV, PREIMPORT_FLAG


def serve(conn: Connection) -> None:
    from ..attention.select import resolve_device
    from ..distributed.spawn import spawn_followers

    args, model_path, tokenizer_path = conn.recv()
    args = dataclasses.replace(args, device=resolve_device(args.device))  # once, for this process and its ranks
    os.environ.update(args.kernel_environment())  # before any kernel loads; the ranks and graph builder inherit it
    # Tensor-parallel followers import torch and the model code while this process does the same.
    followers = spawn_followers(args.tp_size - 1) if args.tp_size > 1 else None

    import torch

    from ..wire.messages import SchedulerError
    from .scheduler import Scheduler

    logging.basicConfig(level=args.log_level.upper())
    torch.set_num_threads(args.num_threads)
    scheduler = None
    try:
        scheduler = Scheduler(args, model_path, tokenizer_path, conn, followers)
        conn.send(scheduler.ready_message())
        scheduler.event_loop()
    except Exception:
        conn.send(SchedulerError(traceback.format_exc()))
        raise
    finally:
        if scheduler is not None:  # stop tensor-parallel followers before this process goes (engine.shutdown waits)
            scheduler.runner.close()


def main() -> None:
    address = sys.argv[1]
    conn = Client(address, authkey=bytes.fromhex(os.environ.pop(AUTHKEY_ENV)))
    if PREIMPORT_FLAG in sys.argv[2:]:
        from . import scheduler  # noqa: F401  (torch, transformers and the model code, ahead of the arguments)
    try:
        serve(conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the engine went away; nothing is left to serve
    finally:
        conn.close()
    # Everything of ours is closed by now (serve's finally stops the runner and its ranks). Tearing torch's modules
    # down takes ~0.6 s that engine.shutdown() would spend waiting, and UCX (loaded by NIXL) crashes in libnl's
    # destructor when the interpreter unloads it: skip native destructors.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

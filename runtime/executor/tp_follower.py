"""A follower rank of tensor parallelism: `python -m furcate.runtime.executor.tp_follower FD`.

It loads its shard of the model, builds KV pools for its KV heads, and then runs every forward rank 0 runs, as
rank 0 hands them over (distributed/followers.py): same batch, same attention metadata, same collectives. It never
samples.
It exits when rank 0 says stop or its pipe closes (rank 0 is gone).
"""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Connection


def serve(pipe: Connection) -> None:
    import torch

    from ..distributed.followers import FollowerCall, FollowerFailed, FollowerStart
    from ..distributed.parallel_state import TensorParallel, join_group, leave_group
    from ..distributed.step_sync import receive_step
    from .model_runner import ModelRunner
    from .rank_control import RankControl, run_call

    start: FollowerStart = pipe.recv()
    args = start.args
    torch.set_num_threads(args.num_threads)
    try:
        join_group(TensorParallel(start.rank, args.tp_size), args.device, port=start.store_port)
        runner = ModelRunner(args, start.model_path, rank=start.rank)
    except Exception:
        pipe.send(FollowerFailed(traceback.format_exc()))
        raise
    pipe.send("ready")
    control = RankControl(runner)
    try:
        while (header := pipe.recv()) is not None:
            if isinstance(header, FollowerCall):
                pipe.send(run_call(control, header))
                continue
            forward, logit_rows = receive_step(header, runner.req_pool, runner.kv_pool, args.device)
            runner.attn_backend.init_forward_metadata(forward)
            runner.run_forward(forward, logit_rows)
    finally:
        leave_group()


def main() -> None:
    pipe = Connection(int(sys.argv[1]))
    try:
        serve(pipe)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # rank 0 went away; nothing is left to follow
    finally:
        pipe.close()
    # Nothing is left to flush or finalize, and tearing down torch's modules takes about a second that rank 0
    # (and so engine.shutdown()) would spend waiting for this process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

"""The RL calls on the scheduler thread: weight updates, the trainer's group, weight reads, memory release.

Each call runs between two steps (the overlap loop's batch in flight lands first), on every tensor-parallel rank
(rank_control.py). After new weights, the prefix cache retires what it holds (radix_cache.py): a flush would fail
while requests still read their cached prefixes (in-place pause, or no pause at all), and keeping those entries
would serve K/V of the old weights to later prompts. Retiring frees what nobody reads at once and the rest when
its readers finish, so it works in every pause mode and no stale K/V is ever matched. A request that runs across
an update keeps its own K/V (SGLang's in-place semantics); its later tokens come from the new weights.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from ...distributed.tp_layers import unshard_tensor
from ...executor.rank_control import RankControl
from ...model.weights.checkpoint import resolve_model_path
from ...wire.control_calls import DestroyGroup, GetWeightVersion, ReleaseMemory, ResumeMemory
from ...wire.messages import ControlResult
from ...wire.weight_messages import GetWeights, InitGroup, UpdateFromDisk, UpdateFromDistributed, UpdateFromTensor
from .base import SchedulerHandle, SchedulerPlugin
from .rpc import Handler

logger = logging.getLogger("furcate.scheduler")


class WeightSync(SchedulerPlugin):
    def __init__(self, scheduler: SchedulerHandle) -> None:
        self.scheduler = scheduler
        self.runner = scheduler.runner
        self.control = RankControl(self.runner)
        self.version = "default"
        self.released: dict[str, str] = {}  # memory tag -> where it comes back from

    @property
    def blocks_forwards(self) -> bool:
        """Weights or K/V memory are released: nothing may run until they are resumed."""
        return bool(self.released)

    def rpc_handlers(self) -> dict[type, Handler]:
        return {
            UpdateFromTensor: self.update_from_tensor,
            UpdateFromDisk: self.update_from_disk,
            InitGroup: self.init_group,
            DestroyGroup: self.destroy_group,
            UpdateFromDistributed: self.update_from_distributed,
            GetWeights: self.get_weights,
            GetWeightVersion: lambda _: self.version,
            ReleaseMemory: self.release,
            ResumeMemory: self.resume,
        }

    # -- updates ------------------------------------------------------------------------------------------

    def update_from_tensor(self, call: UpdateFromTensor) -> ControlResult:
        return self._update("stage_file", (call.path,), call.weight_version, "tensors")

    def update_from_disk(self, call: UpdateFromDisk) -> ControlResult:
        try:
            path = resolve_model_path(call.model_path)
        except (FileNotFoundError, ValueError) as error:
            return ControlResult(False, f"weights not updated: {error}")
        return self._update("stage_disk", (path,), call.weight_version, f"the checkpoint in {path}")

    def update_from_distributed(self, call: UpdateFromDistributed) -> ControlResult:
        return self._update("stage_distributed", (call,), call.weight_version, f"group {call.group_name!r}")

    def _update(self, stage: str, args: tuple, version: str | None, source: str) -> ControlResult:
        """Stage on every rank (each checks its shard), then write on every rank; a failure writes nothing."""
        if "weights" in self.released:
            return ControlResult(False, "weights not updated: they are released; resume_memory_occupation first")
        try:
            count = self.on_every_rank(stage, *args)
        except Exception as error:  # noqa: BLE001 - a bad update is answered; the old weights serve on
            self.on_every_rank_quietly("discard")
            logger.warning("weight update from %s refused: %s", source, error)
            return ControlResult(False, f"weights not updated (the old ones serve on): {error}")
        self.scheduler.drain()  # no forward of the old weights is in flight while they change
        self.on_every_rank("commit")
        held = self.scheduler.cache.retire()
        if version is not None:
            self.version = version
        message = f"updated {count} tensors from {source}; weight_version {self.version!r}"
        if held:
            message += f"; {held} cached tokens still read by running requests are never served again"
        return ControlResult(True, message)

    def on_every_rank(self, method: str, *args: Any) -> Any:
        """RankControl.<method> on this rank and, at the same time, on every follower; this rank's value."""
        return self.values_on_every_rank(method, *args)[0]

    def values_on_every_rank(self, method: str, *args: Any) -> list[Any]:
        """Every rank's value of RankControl.<method>, in rank order."""
        followers = self.runner.followers
        followers.start_call(method, *args)
        try:
            value = getattr(self.control, method)(*args)
        except BaseException:
            with contextlib.suppress(RuntimeError):  # the followers failed alike; this rank's error says why
                followers.finish_call()
            raise
        return [value, *followers.finish_call()]

    def on_every_rank_quietly(self, method: str) -> None:
        try:
            self.on_every_rank(method)
        except Exception as error:  # noqa: BLE001 - cleaning up after a failure already reported
            logger.warning("%s after a failed update: %s", method, error)

    # -- the trainer's group ------------------------------------------------------------------------------

    def init_group(self, call: InitGroup) -> ControlResult:
        last = call.rank_offset + self.runner.tp.size - 1
        if last >= call.world_size:
            return ControlResult(False, f"world_size {call.world_size} has no room for ranks {call.rank_offset}.."
                                        f"{last} (this engine has tp_size {self.runner.tp.size})")
        return self._answer(lambda: self.on_every_rank("join_group", call),
                            f"joined weight update group {call.group_name!r}", "could not join the group")

    def destroy_group(self, call: DestroyGroup) -> ControlResult:
        group_name = call.group_name
        if not isinstance(group_name, str) or group_name not in self.control.groups:
            return ControlResult(False, f"no weight update group {group_name!r}")
        return self._answer(lambda: self.on_every_rank("leave_group", group_name),
                            f"destroyed weight update group {group_name!r}", "could not destroy the group")

    @staticmethod
    def _answer(run: Callable[[], Any], done: str, failed: str) -> ControlResult:
        try:
            run()
        except Exception as error:  # noqa: BLE001 - a trainer that never came or went away fails this call only
            return ControlResult(False, f"{failed}: {type(error).__name__}: {error}")
        return ControlResult(True, done)

    def get_weights(self, call: GetWeights) -> list:
        if "weights" in self.released:
            raise ValueError("weights are released; resume_memory_occupation first")
        shards = [torch.from_numpy(shard) for shard in self.values_on_every_rank("read_shard", call.name)]
        whole = unshard_tensor(call.name, shards, self.runner.config.vocab_size)
        return whole[: call.truncate_size].tolist()

    # -- memory -------------------------------------------------------------------------------------------

    def release(self, call: ReleaseMemory) -> ControlResult:
        tags = tuple(tag for tag in call.tags if tag not in self.released and tag != "cuda_graph")
        s = self.scheduler
        holders = s.kv_holders() + len(s.held_requests())
        if holders:
            return ControlResult(False, f"memory not released: {holders} request(s) hold K/V; "
                                        "pause_generation(mode='abort' or 'retract') first")
        s.drain()
        if "kv_cache" in tags:
            s.cache.flush()
            self.on_every_rank("release_kv")
            self.released["kv_cache"] = "reallocated"
        if "weights" in tags:
            path = self.on_every_rank("release_weights")
            self.released["weights"] = path
        return ControlResult(True, f"released {list(tags) or 'nothing new'}" +
                             (f"; weights spilled to {self.released['weights']}" if "weights" in tags else ""))

    def resume(self, call: ResumeMemory) -> ControlResult:
        tags, done = call.tags, []
        if "kv_cache" in tags and "kv_cache" in self.released:
            self.on_every_rank("resume_kv")
            del self.released["kv_cache"]
            done.append("kv_cache (reallocated)")
        if "weights" in tags and "weights" in self.released:
            path = self.on_every_rank("resume_weights")
            del self.released["weights"]
            done.append(f"weights (read back from the spill file {path})")
        if done or "cuda_graph" in tags:
            self.runner.recapture_graphs()
        return ControlResult(True, f"resumed {', '.join(done) or 'nothing (not released)'}")

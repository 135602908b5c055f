"""What every tensor-parallel rank does to its own weights and memory for an RL control call.

Rank 0 runs each method here and has its followers run the same one by name (Followers.call), so one code path
serves tp_size 1 and 2. Updates come in two phases: stage_* reads and checks every tensor of this rank's shard
(nothing written), commit() writes what was staged. A rank that fails to stage fails the call on every rank
before any weight changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..cache import huge_pages
from ..distributed.followers import FollowerCall, FollowerReply
from ..distributed.weight_group import destroy_weight_group, init_weight_group, receive_broadcast
from ..model.packed_linear import repack_linears, unpack_linears
from ..model.weights.weight_update import Placement, WeightWriter, check_values
from ..wire.tensor_specs import TensorSpec, parse_dtype, spec_of, tensor_specs
from ..wire.weight_messages import InitGroup, UpdateFromDistributed

SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclass
class Staged:
    placements: list[Placement] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)


class RankControl:
    """One rank's model and KV pool, as the RL calls change them."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.writer = WeightWriter(runner.model)
        self.staged: Staged | None = None
        self.groups: dict[str, torch.distributed.ProcessGroup] = {}
        self.spill_dir: str | None = None  # released weights, written here until resumed

    # -- updates: stage, then commit ----------------------------------------------------------------------

    def stage_file(self, path: str) -> int:
        """The tensors of an update_weights_from_tensor, from the safetensors file the engine wrote."""
        try:
            named = load_file(path)
        except (SafetensorError, ValueError, RuntimeError, OSError) as error:
            raise ValueError(f"the serialized tensors are not a safetensors buffer: {error}") from None
        if not named:
            raise ValueError("the update holds no tensors")
        return self._stage([spec_of(name, tensor) for name, tensor in named.items()], list(named.values()))

    def stage_disk(self, model_path: str) -> int:
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files in {model_path}")
        specs, tensors = [], []
        try:
            for file in files:
                with safe_open(file, framework="pt") as handle:
                    for name in handle.keys():
                        specs.append(disk_spec(name, handle.get_slice(name)))
            placements = self.writer.plan(specs)  # every name and shape checked before any tensor is read
            self._require_every_parameter(placements, model_path)
            for file in files:
                with safe_open(file, framework="pt") as handle:
                    tensors += [handle.get_tensor(name) for name in handle.keys()]
        except (SafetensorError, OSError) as error:
            raise ValueError(f"cannot read the checkpoint in {model_path}: {error}") from None
        return self._stage(specs, tensors, placements)

    def stage_distributed(self, call: UpdateFromDistributed) -> int:
        group = self.groups.get(call.group_name)
        if group is None:
            raise ValueError(f"no weight update group {call.group_name!r}; call init_weights_update_group first")
        specs = tensor_specs(call.names, call.dtypes, call.shapes)
        placements = self.writer.plan(specs)
        tensors = []
        for spec in specs:
            tensor = torch.empty(spec.shape, dtype=spec.dtype)
            receive_broadcast(group, tensor)
            tensors.append(tensor)
        return self._stage(specs, tensors, placements)

    def _stage(self, specs: list[TensorSpec], tensors: list[torch.Tensor],
               placements: list[Placement] | None = None) -> int:
        self.staged = None
        placements = self.writer.plan(specs) if placements is None else placements
        check_values(placements, tensors)
        self.staged = Staged(placements, tensors)
        return len(tensors)

    def _require_every_parameter(self, placements: list[Placement], model_path: str) -> None:
        """A checkpoint replaces the whole model: every parameter, every part of a fused one, every expert."""
        missing = self.writer.unwritten(placements)
        if missing:
            raise ValueError(f"the checkpoint in {model_path} lacks tensors for {missing[:4]}")

    def commit(self) -> int:
        staged, self.staged = self.staged, None
        if staged is None:
            raise RuntimeError("no update is staged")
        self.writer.write(staged.placements, staged.tensors)
        repack_linears(self.runner.model)
        return len(staged.tensors)

    def discard(self) -> None:
        self.staged = None

    def read_shard(self, name: str) -> np.ndarray:
        """This rank's part of tensor `name`, as float32 numpy (pickled by value through a follower's pipe)."""
        return self.writer.read(name).float().numpy()

    # -- the trainer's group ------------------------------------------------------------------------------

    def join_group(self, call: InitGroup) -> None:
        if call.group_name in self.groups:
            raise ValueError(f"weight update group {call.group_name!r} exists; destroy it first")
        rank = call.rank_offset + self.runner.tp.rank
        self.groups[call.group_name] = init_weight_group(call.master_address, call.master_port, rank,
                                                         call.world_size, call.group_name, call.backend,
                                                         call.timeout_s)

    def leave_group(self, group_name: str) -> bool:
        group = self.groups.pop(group_name, None)
        if group is not None:
            destroy_weight_group(group)
        return group is not None

    # -- memory -------------------------------------------------------------------------------------------

    def release_kv(self) -> None:
        self.runner.kv_pool.release()
        trim_heap()

    def resume_kv(self) -> None:
        self.runner.kv_pool.restore()

    def release_weights(self) -> str:
        """Write every weight to a spill file, then let go of it; returns the file."""
        tensors = model_tensors(self.runner.model)
        self.spill_dir = tempfile.mkdtemp(prefix="furcate-weights-")
        path = os.path.join(self.spill_dir, f"rank{self.runner.tp.rank}.safetensors")
        save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, path)
        for tensor in tensors.values():
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        unpack_linears(self.runner.model)
        trim_heap()
        return path

    def resume_weights(self) -> str:
        path = os.path.join(self.spill_dir, f"rank{self.runner.tp.rank}.safetensors")
        saved = load_file(path)
        for name, tensor in model_tensors(self.runner.model).items():
            tensor.data = saved[name].to(tensor.device)
        huge_pages.collapse(saved.values())
        repack_linears(self.runner.model)
        shutil.rmtree(self.spill_dir, ignore_errors=True)
        self.spill_dir = None
        return path


def disk_spec(name: str, piece) -> TensorSpec:
    kind = piece.get_dtype()
    if kind not in SAFETENSORS_DTYPES:
        raise ValueError(f"checkpoint tensor {name!r} is {kind}; updates take {sorted(SAFETENSORS_DTYPES)}")
    return TensorSpec(name, parse_dtype(SAFETENSORS_DTYPES[kind]), tuple(piece.get_shape()))


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer once (a tied LM head is the embedding's tensor)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def trim_heap() -> None:
    """Hand freed heap pages back to the OS now (glibc keeps small freed blocks; RSS would not drop)."""
    name = ctypes.util.find_library("c")
    if name:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)


def run_call(control: RankControl, call: FollowerCall) -> FollowerReply:
    """A follower's side of Followers.call: the method's value, or its error as text (rank 0 raises it)."""
    try:
        return FollowerReply(value=getattr(control, call.method)(*call.args))
    except Exception as error:  # noqa: BLE001 - reported to rank 0, which fails the call; this rank serves on
        return FollowerReply(error=f"{type(error).__name__}: {error}")

"""The Engine's RL calls, with SGLang's names and arguments: weight updates, the trainer's group, memory release,
pause and continue. Each checks its arguments here (ValueError), crosses as a typed control call and runs on the
scheduler between two steps (scheduler/plugins/weight_sync.py, scheduler/plugins/generation_control.py). Updates
answer (success, message) as SGLang's do.
"""

from __future__ import annotations

import base64
import binascii
import os
import tempfile
from collections.abc import Iterable
from typing import Any

import torch
from safetensors.torch import save as save_blob

from ..wire.control_calls import (
    AbortAll,
    ContinueGeneration,
    DestroyGroup,
    GetWeightVersion,
    PauseGeneration,
    ReleaseMemory,
    ResumeMemory,
)
from ..wire.messages import ControlResult
from ..wire.tensor_specs import tensor_specs
from ..wire.weight_messages import (
    DEFAULT_GROUP,
    DEFAULT_GROUP_TIMEOUT_S,
    PAUSE_MODES,
    GetWeights,
    UpdateFromDisk,
    UpdateFromDistributed,
    UpdateFromTensor,
    check_choice,
    check_flag,
    check_int,
    check_text,
    init_group,
    memory_tags,
)

LOAD_FORMATS = (None, "direct")
SPOOL_DIR = "/dev/shm"  # memory-backed where Linux has it: the scheduler reads the update without a disk
UPDATE_TIMEOUT_S = 24 * 3600.0  # the scheduler's own waits (the group's timeout) end a stuck update first
MAX_TRUNCATE = 1 << 20


def serialize_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> str:
    """The `serialized_named_tensors` entry of POST /update_weights_from_tensor: the tensors as one safetensors
    buffer, base64. (SGLang's own entries are pickles of shared-memory handles, which only its processes can open
    and which no server should unpickle from a request.)"""
    return base64.b64encode(tensors_blob(named_tensors)).decode("ascii")


def tensors_blob(named_tensors: Any) -> bytes:
    pairs = list(named_tensors.items()) if isinstance(named_tensors, dict) else named_tensors
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise ValueError("named_tensors must be a non-empty list of (name, tensor) pairs or a dict")
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"named_tensors holds {type(pair).__name__}, not a (name, tensor) pair")
        name, tensor = pair
        check_text("a tensor name", name)
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"tensor {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.untyped_storage().data_ptr() in seen:  # safetensors refuses tensors that share memory
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    return save_blob(tensors)


def decode_serialized(entries: Any) -> bytes:
    """SGLang's list of one entry per tensor-parallel rank; furcate's entries are whole tensors, so the first is
    read (the others, if any, must be the same)."""
    if not isinstance(entries, list) or not entries or not all(isinstance(e, str) for e in entries):
        raise ValueError("serialized_named_tensors must be a non-empty list of base64 strings "
                         "(furcate.serialize_named_tensors makes one)")
    if any(entry != entries[0] for entry in entries[1:]):
        raise ValueError("serialized_named_tensors entries differ; send the same whole tensors for every rank")
    try:
        return base64.b64decode(entries[0], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("serialized_named_tensors[0] is not base64") from None


def _version(weight_version: Any) -> str | None:
    return check_text("weight_version", weight_version, optional=True)


def _load_format(load_format: Any) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; furcate takes the tensors themselves "
                         "(load_format null or 'direct')")


class EngineRl:
    """Mixed into Engine: needs its _rpc(call, timeout), abort(rid) and _link."""

    def _control(self, call: Any, timeout: float = 600) -> tuple[bool, str]:
        result: ControlResult = self._rpc(call, timeout=timeout)
        return result.success, result.message

    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, weight_version: str | None = None) -> tuple[bool, str]:
        """New weights from tensors in this process, named as in the HF checkpoint (fused layers are filled from
        their parts); every tensor is checked before any is written."""
        _load_format(load_format)
        return self._update_from_blob(tensors_blob(named_tensors), flush_cache, weight_version)

    def update_serialized_weights(self, serialized_named_tensors: Any, load_format: str | None = None,
                                  flush_cache: bool = True, weight_version: str | None = None) -> tuple[bool, str]:
        """update_weights_from_tensor's HTTP form (serialize_named_tensors entries)."""
        _load_format(load_format)
        return self._update_from_blob(decode_serialized(serialized_named_tensors), flush_cache, weight_version)

    def _update_from_blob(self, blob: bytes, flush_cache: Any, weight_version: Any) -> tuple[bool, str]:
        """The tensors go to the scheduler as a file, not down its pipe (513 MB took 1.9 s there), and every
        tensor-parallel rank reads the same file."""
        flush, version = check_flag("flush_cache", flush_cache), _version(weight_version)
        with tempfile.NamedTemporaryFile(dir=SPOOL_DIR if os.path.isdir(SPOOL_DIR) else None, prefix="furcate-",
                                         suffix=".safetensors") as spool:
            spool.write(blob)
            spool.flush()
            return self._control(UpdateFromTensor(spool.name, flush, version), UPDATE_TIMEOUT_S)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 weight_version: str | None = None) -> tuple[bool, str]:
        """New weights from an HF checkpoint directory (or GGUF file) of the same architecture and shapes."""
        if load_format not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {load_format!r} is not supported (null, 'auto' or 'safetensors')")
        call = UpdateFromDisk(check_text("model_path", model_path), _version(weight_version))
        return self._control(call, UPDATE_TIMEOUT_S)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = DEFAULT_GROUP, backend: str = "gloo",
                                  timeout: float = DEFAULT_GROUP_TIMEOUT_S) -> tuple[bool, str]:
        """Join the trainer's group (the trainer is rank 0; this engine's ranks are rank_offset onwards). Fails,
        and the engine serves on, if the trainer has not joined within `timeout` seconds."""
        call = init_group(master_address, master_port, rank_offset, world_size, group_name, backend, timeout)
        return self._control(call, call.timeout_s + 60)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> tuple[bool, str]:
        return self._control(DestroyGroup(check_text("group_name", group_name)))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[Any],
                                        group_name: str = DEFAULT_GROUP, flush_cache: bool = True,
                                        weight_version: str | None = None,
                                        load_format: str | None = None) -> tuple[bool, str]:
        """Receive each tensor, in order, as the trainer broadcasts it in the group."""
        _load_format(load_format)
        tensor_specs(names, dtypes, shapes)  # the scheduler checks them against the model
        call = UpdateFromDistributed(list(names), list(dtypes), [list(s) if isinstance(s, (list, tuple)) else s
                                                                  for s in shapes],
                                     check_text("group_name", group_name), check_flag("flush_cache", flush_cache),
                                     _version(weight_version))
        return self._control(call, UPDATE_TIMEOUT_S)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first truncate_size rows of a tensor (HF name), as float lists."""
        call = GetWeights(check_text("name", name), check_int("truncate_size", truncate_size, 1, MAX_TRUNCATE))
        return self._rpc(call)

    def get_weight_version(self) -> str:
        return self._rpc(GetWeightVersion())

    def release_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        """Give back the weights' and/or the K/V cache's memory; returns once it is given back."""
        return self._control(ReleaseMemory(memory_tags(tags)), UPDATE_TIMEOUT_S)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        return self._control(ResumeMemory(memory_tags(tags)), UPDATE_TIMEOUT_S)

    def pause_generation(self, mode: str = "abort") -> tuple[bool, str]:
        """abort: every request ends now with its partial output; retract: running requests requeue, their K/V
        freed; in_place: they stay as they are. Nothing runs until continue_generation()."""
        return self._control(PauseGeneration(check_choice("mode", mode, PAUSE_MODES)))

    def continue_generation(self) -> tuple[bool, str]:
        return self._control(ContinueGeneration())

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """SGLang's form of abort(): one request (and those derived from it), or with abort_all every one."""
        if check_flag("abort_all", abort_all):
            self._link.withdraw_all()  # ahead of the call, which goes ahead of every request still to be sent
            self._control(AbortAll())
            return
        self.abort(check_text("rid", rid))

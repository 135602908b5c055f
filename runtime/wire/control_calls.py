"""The control calls the engine sends the scheduler (RpcReq.call), one type each: the scheduler answers a call by
its type (scheduler/plugins/rpc.py), so a call's name is written once, here. The RL calls' arguments that need
checking live in weight_messages.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GetStats:
    """The scheduler's counters and each plug-in's."""


@dataclass(frozen=True)
class CheckIntegrity:
    """Verify the KV bookkeeping: every slot free, cached or owned by one request."""


@dataclass(frozen=True)
class Shutdown:
    """Stop the loop; answered before the scheduler process exits."""


@dataclass(frozen=True)
class FlushCache:
    """Drop the prefix cache (refused while running requests hold parts of it)."""


@dataclass(frozen=True)
class PauseGeneration:
    mode: str  # weight_messages.PAUSE_MODES


@dataclass(frozen=True)
class ContinueGeneration:
    """Scheduling resumes after a pause."""


@dataclass(frozen=True)
class AbortAll:
    """Every request ends now, with what it has generated."""


@dataclass(frozen=True)
class GetWeightVersion:
    """The weight_version the last update named."""


@dataclass(frozen=True)
class DestroyGroup:
    group_name: str


@dataclass(frozen=True)
class ReleaseMemory:
    tags: tuple[str, ...]  # weight_messages.MEMORY_TAGS


@dataclass(frozen=True)
class ResumeMemory:
    tags: tuple[str, ...]

"""What a freeze or a thaw did, for the caller and for checkpoint metadata."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Frozen:
    """Every CUDA process of a container is CHECKPOINTED: CRIU may dump it now."""

    container_id: str
    backend: str
    pids: tuple[int, ...]
    memory_bytes: Mapping[int, int]
    gpu_uuids: Mapping[int, tuple[str, ...]]
    skipped: Mapping[int, str]  # pid -> why it needed no freezing
    lock_s: float  # wall time of the lock phase (waiting for submitted work)
    checkpoint_s: float  # wall time of the checkpoint phase (GPU -> host copies)

    @property
    def total_bytes(self) -> int:
        return sum(self.memory_bytes.get(pid, 0) for pid in self.pids)

    @property
    def checkpoint_gbps(self) -> float | None:
        return gbps(self.total_bytes, self.checkpoint_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "processes": [
                {
                    "pid": pid,
                    "memoryBytes": self.memory_bytes.get(pid, 0),
                    "gpuUuids": list(self.gpu_uuids.get(pid, ())),
                }
                for pid in self.pids
            ],
            "skipped": {str(pid): why for pid, why in self.skipped.items()},
            "bytes": self.total_bytes,
            "lockS": round(self.lock_s, 3),
            "checkpointS": round(self.checkpoint_s, 3),
            "checkpointGBps": round3(self.checkpoint_gbps),
        }


@dataclass(frozen=True, slots=True)
class Thawed:
    """Every CUDA process of a container is RUNNING again."""

    container_id: str
    backend: str
    restored: tuple[int, ...]  # went through restore and unlock
    unlocked: tuple[int, ...]  # were LOCKED already: unlock only
    already_running: tuple[int, ...]  # someone else (CRIU's CUDA plugin) did it
    skipped: Mapping[int, str]
    device_map: Mapping[str, str]
    restore_s: float
    unlock_s: float
    total_bytes: int  # of the restored processes, where known
    notes: tuple[str, ...] = ()  # failures that a retry repaired

    @property
    def restore_gbps(self) -> float | None:
        return gbps(self.total_bytes, self.restore_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "restored": list(self.restored),
            "unlocked": list(self.unlocked),
            "alreadyRunning": list(self.already_running),
            "skipped": {str(pid): why for pid, why in self.skipped.items()},
            "deviceMap": dict(self.device_map),
            "bytes": self.total_bytes,
            "restoreS": round(self.restore_s, 3),
            "unlockS": round(self.unlock_s, 3),
            "restoreGBps": round3(self.restore_gbps),
            "notes": list(self.notes),
        }


def gbps(nbytes: int, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if nbytes and seconds > 0 else None


def round3(value: float | None) -> float | None:
    return None if value is None else round(value, 3)

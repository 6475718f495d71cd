"""What the lifecycle needs of an event sink: hand an event over, never wait for it.

The containerd Task service's sender is task/events.py's :class:`Publisher` (ttrpc to
containerd); the Slurm runner logs them (slurm/job_run.py); tests collect them."""

from __future__ import annotations

from typing import Protocol

from google.protobuf.message import Message


class EventSender(Protocol):
    def send(self, event: Message) -> None: ...


__all__ = ["EventSender"]

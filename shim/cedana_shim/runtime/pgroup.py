"""Killing a ``runc restore`` (and everything it restored) or a ``runc checkpoint``,
found again by process group.

``runc restore`` and ``runc checkpoint`` run in a process group of their own (runc,
CRIU, CRIU's action scripts), recorded in the bundle while they run
(:func:`cedana_shim.bundle_state.mark_criu_group`). The tasks CRIU restores are not in
that group: they get their own sessions back, and the root task is runc's child (runc
has CRIU restore it as its sibling). Killing CRIU does not kill them: held at
post-restore (the shim's gate) they wait, every signal but SIGKILL blocked, forever.
So a restore is stopped by freezing the group, SIGKILLing every descendant of its
members, then the group itself (:func:`kill_criu_group`): by the driver when a restore is
abandoned, by ``delete`` when the daemon died mid-restore. A checkpoint is stopped the
same way: the container's tasks are not CRIU's children, but while a CRIU that has
seized them lives (held in an action script, say) they cannot die, frozen or traced.
``delete`` runs on containerd's cleanup path, so this module imports only ``os`` and
``time`` (and ``signal`` once there is something to kill).

Identity: a pid is never handed out again while a process group of that number has a
member, so while the leader lives its start time tells the group apart from a reused
pid, and once the leader is gone any member left in the group is from the original
group. (Not covered: the group emptied, its number reused by a new process that made a
group of its own and then exited leaving members behind; that takes a full pid-space
wrap between two reads of a few milliseconds.)
"""

from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # typing costs delete an import
if TYPE_CHECKING:
    from collections.abc import Callable

POLL_INTERVAL = 0.01
_DEAD = (b"Z", b"X")


class _Proc:
    __slots__ = ("dead", "pgid", "ppid", "start")

    def __init__(self, fields: list[bytes]) -> None:
        # /proc/<pid>/stat from field 3: state, ppid, pgrp, ... starttime (field 22).
        self.dead = fields[0] in _DEAD
        self.ppid = int(fields[1])
        self.pgid = int(fields[2])
        self.start = int(fields[19])


def _read(pid: int | str) -> _Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    try:
        return _Proc(stat[stat.rfind(b")") + 2 :].split())
    except (IndexError, ValueError):
        return None


def _processes() -> dict[int, _Proc]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            proc = _read(entry)
            if proc is not None:
                found[int(entry)] = proc
    return found


def start_time(pid: int) -> int | None:
    """When ``pid`` started (field 22 of /proc/<pid>/stat, clock ticks after boot)."""
    proc = _read(pid)
    return None if proc is None else proc.start


def has_live_members(pgid: int) -> bool:
    """Does any process other than a zombie belong to process group ``pgid``?"""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg counts zombies, which may wait a while for a reaper: ask /proc.
    return any(p.pgid == pgid and not p.dead for p in _processes().values())


def is_same_group(pgid: int, leader_start: int) -> bool:
    """Is ``pgid`` still the group whose leader started at ``leader_start``?"""
    if pgid <= 1:
        return False
    now = start_time(pgid)
    if now is not None:
        return now == leader_start  # a different start time: the pid was reused
    return has_live_members(pgid)


def _tree(pgid: int, procs: dict[int, _Proc]) -> tuple[set[int], dict[int, int]]:
    """The group's live members, and their descendants outside it (pid -> start time)."""
    members = {pid for pid, p in procs.items() if p.pgid == pgid and not p.dead}
    children: dict[int, list[int]] = {}
    for pid, p in procs.items():
        if not p.dead:
            children.setdefault(p.ppid, []).append(pid)
    below: dict[int, int] = {}
    stack = list(members)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in below and child not in members:
                below[child] = procs[child].start
                stack.append(child)
    return members, below


def kill_criu_group(pgid: int, leader_start: int, timeout: float) -> bool:
    """SIGKILL the group, if it is still the recorded one, and every descendant of its
    members; wait up to ``timeout`` seconds until none of them lives. True when none is
    left."""
    if not is_same_group(pgid, leader_start):
        return True
    import signal

    try:
        os.killpg(pgid, signal.SIGSTOP)  # nothing in it forks while the tree is read
    except ProcessLookupError:
        return True
    _, below = _tree(pgid, _processes())
    # Descendants first: while their parents are stopped nobody reaps them, so their
    # pids cannot have been handed to anyone else.
    for pid in below:
        _send(os.kill, pid, signal.SIGKILL)
    _send(os.killpg, pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while has_live_members(pgid) or any(_lives(pid, start) for pid, start in below.items()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_INTERVAL)
    return True


def _send(kill: Callable[[int, int], None], target: int, sig: int) -> None:
    try:
        kill(target, sig)
    except ProcessLookupError:
        return  # gone already: nothing to kill


def _lives(pid: int, start: int) -> bool:
    proc = _read(pid)
    return proc is not None and proc.start == start and not proc.dead

"""A server whose workers drop root, as web servers and databases do, checkpointed on
stop and resumed: on a node whose root has CAP_SYS_RESOURCE (as real nodes have; this
project's host does not) CRIU dumps processes of other users.

The container's root init (the master) adds a user, starts two workers that run as that
user (`su`: each keeps a token and a count in memory and prints them), and busybox httpd,
which binds its port as root and serves as that user.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from pathlib import Path

from integration.harness import procs
from integration.harness.config import CTR_NAMESPACE
from integration.harness.containerd import Containerd
from integration.harness.cr_events import TOPIC_EXIT, EventStream
from integration.harness.cr_support import Workloads, restored_from
from integration.harness.ctr import Ctr
from integration.harness.util import wait_for

from .nodes import TIMEOUT

NewId = Callable[[str], str]
APP_UID = 1000
WORKERS = 2
_LINE = re.compile(r"^worker (\d) ([0-9a-f-]{36}) (\d+)$")

MASTER = (
    "trap 'echo got-TERM; exit 143' TERM\n"
    f"echo 'app:x:{APP_UID}:{APP_UID}::/tmp:/bin/sh' >> /etc/passwd\n"
    f"echo 'app:x:{APP_UID}:' >> /etc/group\n"
    "mkdir -p /www && echo served-by-app > /www/index.html\n"
    f"for n in $(seq {WORKERS}); do\n"
    "  su app -s /bin/sh -c 'tok=$(cat /proc/sys/kernel/random/uuid); i=0; "
    "while :; do i=$((i+1)); echo \"worker '$n' $tok $i\"; sleep 0.5; done' &\n"
    "done\n"
    "httpd -f -p 127.0.0.1:8080 -u app -h /www &\n"
    "while :; do sleep 1; done\n"
)


def _workers(lines: list[str]) -> dict[int, tuple[str, list[int]]]:
    """worker number -> (its token, its counts), from the container's output."""
    found: dict[int, tuple[str, list[int]]] = {}
    for line in lines:
        if m := _LINE.match(line):
            token, counts = found.setdefault(int(m[1]), (m[2], []))
            assert token == m[2], f"worker {m[1]} printed two tokens: {token}, {m[2]}"
            counts.append(int(m[3]))
    return found


def _ticking(lines: Callable[[], list[str]], count: int) -> dict[int, tuple[str, list[int]]]:
    def enough() -> dict[int, tuple[str, list[int]]] | None:
        found = _workers(lines())
        done = len(found) == WORKERS and all(len(c) >= count for _, c in found.values())
        return found if done else None

    return wait_for(
        enough, timeout=TIMEOUT, interval=0.2, what=f"{WORKERS} workers with {count} lines"
    )


def _app_processes(init: int) -> dict[int, tuple[str, str]]:
    """The container's long-lived processes running as the app user (the workers'
    shells, httpd; not a worker's `sleep` of the moment): pid -> (comm, pid inside)."""
    found = {}
    for pid in procs.descendants({init}):
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            continue
        status = dict(line.split(":", 1) for line in text.splitlines())
        name = status["Name"].strip()
        if status["Uid"].split()[:1] == [str(APP_UID)] and name != "sleep":
            found[pid] = (name, status["NSpid"].split()[-1])
    return found


def test_a_server_with_workers_of_another_user_resumes_with_them(
    containerd: Containerd, ctr: Ctr, new_id: NewId
) -> None:
    label = f"workers-{uuid.uuid4().hex[:8]}"
    with (
        EventStream(containerd.socket) as events,
        Workloads(containerd, new_id, label=label, script=MASTER, namespace=CTR_NAMESPACE) as w,
    ):
        first = w.start("first")
        _ticking(first.lines, 2)

        def with_httpd() -> dict[int, tuple[str, str]] | None:
            found = _app_processes(w.pid(first))
            return found if [c for c, _ in found.values()].count("httpd") == 1 else None

        before_users = wait_for(with_httpd, timeout=TIMEOUT, what="httpd running as app")
        ctr("task", "kill", "-s", "SIGTERM", first.cid)
        committed = events.wait_commit(first.cid, timeout=TIMEOUT)
        exited = events.wait_topic(TOPIC_EXIT, first.cid, id=first.cid, timeout=TIMEOUT)
        assert exited.field("exit_status") == 143, exited
        assert "got-TERM" not in first.lines()
        before = _workers(first.lines())
        w.delete(first)

        second = w.start("second")
        restored_from(events, second, committed.checkpoint_id)
        after = _ticking(second.lines, 2)
        for n, (token, counts) in after.items():
            old_token, old_counts = before[n]
            assert token == old_token, f"worker {n} started over (a new token)"
            assert old_counts[-1] < counts[0] <= old_counts[-1] + 3, (n, old_counts, counts)
        users = _app_processes(w.pid(second))
        assert sorted(users.values()) == sorted(before_users.values()), (
            "the app user's processes (name, pid inside) differ after the restore: "
            f"{sorted(before_users.values())} -> {sorted(users.values())}"
        )
        page = ctr("task", "exec", "--exec-id", "get", second.cid, "wget", "-qO-",
                   "http://127.0.0.1:8080/").stdout  # fmt: skip
        assert page == "served-by-app\n", page

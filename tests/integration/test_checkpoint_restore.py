"""Label-driven checkpoint/restore, end to end: the container's env says
`CEDANA_CHECKPOINT=<label>`; stopping it checkpoints it (CRIU through runc, rootfs diff,
/dev/shm) into the node's store; the next container with that label, in the same
Kubernetes namespace (or containerd namespace outside the CRI), resumes from it.

Everything is real: containerd 1.6/1.7/2.1, CRI over gRPC as kubelet calls it, runc,
CRIU 4.1, overlay rootfs, CNI bridge pods. The proof of a restore is the workload's own
state: a counter that lives only in a shell variable, a token drawn once by the first
incarnation, files it wrote and deleted. Waits are on containerd's event stream (the
shim publishes `/cedana/checkpoint/committed`, `/cedana/restore`, ...), never fixed
sleeps. The fault cases are in test_checkpoint_faults.py.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cedana_shim.api.cri.v1 import api_pb2 as cri_pb

from .harness import procs
from .harness.config import CRI_NAMESPACE, CTR_NAMESPACE
from .harness.containerd import Containerd
from .harness.cr_events import (
    TOPIC_COMMITTED,
    TOPIC_EXIT,
    TOPIC_FAILED,
    TOPIC_RESTORE,
    Event,
    EventStream,
)
from .harness.cr_support import (
    DELETED_FILE,
    ShimLog,
    assert_continues,
    counter_script,
    entries,
    file_lines,
    parse_ticks,
    rootfs_diff_file,
    store_is_sound,
    wait_ticks,
)
from .harness.cri import CriClient, Pod
from .harness.cri_apps import ENV_LABEL, App, cri_stdout, start_app, stop_app
from .harness.ctr import Ctr
from .harness.util import wait_for

NewId = Callable[[str], str]
ENV_INTERVAL = "CEDANA_CHECKPOINT_INTERVAL"
# Generous: a checkpoint of this workload takes well under a second here; the limits
# only bound a hang.
COMMIT_TIMEOUT = 60
MANY_PAIRS = 1500  # connections the many-sockets process holds to itself
# -- CRI ----------------------------------------------------------------------------------


def sh(cri: CriClient, cid: str, script: str) -> str:
    res = cri.exec_sync(cid, ["sh", "-c", script])
    assert res.exit_code == 0, (res.exit_code, res.stdout, res.stderr)
    return res.stdout.decode()


# Files the workload made, as seen from inside: its token in the rootfs and in /dev/shm,
# the rootfs count, and whether the image file it deleted is back.
_PROBE = (
    "cat /var/token /dev/shm/token /var/count; "
    f"if [ -e {DELETED_FILE} ]; then echo present; else echo deleted; fi"
)


@dataclass(frozen=True)
class Files:
    rootfs_token: str
    shm_token: str
    count: int
    deleted: bool


def probe(cri: CriClient, cid: str) -> Files:
    lines = sh(cri, cid, _PROBE).split()
    assert len(lines) == 4, lines
    return Files(lines[0], lines[1], int(lines[2]), lines[3] == "deleted")


# -- the tests ----------------------------------------------------------------------------


def test_cri_stop_checkpoints_and_new_pod_resumes(containerd: Containerd, cri: CriClient) -> None:
    """Kubelet's pod deletion (StopContainer with a grace period, then the sandbox) takes a
    checkpoint; a NEW pod in the same namespace with the same label resumes from it:
    memory (counter, token), rootfs file and deletion, /dev/shm, and stdout into the new
    container's CRI log."""
    label = f"cri-{uuid.uuid4().hex[:8]}"
    kns = f"ns-{uuid.uuid4().hex[:6]}"
    log = ShimLog(containerd)
    with EventStream(containerd.socket) as events, contextlib.ExitStack() as stack:
        first = start_app(stack, containerd, cri, label=label, namespace=kns)
        cold = events.wait_topic(TOPIC_RESTORE, first.cid, timeout=30)
        assert cold.field("outcome") == "cold", cold
        wait_ticks(first.stdout, count=5)
        seen = probe(cri, first.cid)
        assert seen.rootfs_token == seen.shm_token and seen.deleted, seen

        stop_app(cri, first)  # exit 143: the shim's checkpoint ended the process
        committed = events.wait_commit(first.cid, timeout=COMMIT_TIMEOUT)
        assert (committed.field("scope"), committed.field("label")) == (kns, label)
        assert committed.field("reason") == "stop"
        before = parse_ticks(first.stdout())
        assert before is not None and before.token == seen.rootfs_token
        assert "got-TERM" not in first.stdout(), "SIGTERM reached the workload: no checkpoint"
        assert not events.of(TOPIC_FAILED, first.cid)
        listed = entries(containerd.store, scope=kns, label=label)
        assert [e.id for e in listed] == [committed.checkpoint_id]
        meta = listed[0].metadata
        assert (meta["reason"], meta["container"], meta["pod"]) == ("stop", "app", "counter")
        store_is_sound(containerd.store)

        second = start_app(stack, containerd, cri, label=label, namespace=kns)
        outcome = events.wait_topic(TOPIC_RESTORE, second.cid, timeout=30)
        assert outcome.field("outcome") == "restored", outcome
        assert outcome.checkpoint_id == committed.checkpoint_id
        after = wait_ticks(second.stdout, count=3)
        assert_continues(before, after, "CRI restore")
        files = probe(cri, second.cid)
        assert files.rootfs_token == before.token, "rootfs file not restored"
        assert files.shm_token == before.token, "/dev/shm file not restored"
        assert files.deleted, f"{DELETED_FILE}, deleted before the checkpoint, is back"
        assert files.count >= after.first
        # The new container's log keeps growing with the continued count.
        later = wait_ticks(second.stdout, count=len(after.values) + 5)
        assert_continues(before, later, "CRI restore, later")
        status = cri.container_status(second.cid).status
        assert status.state == cri_pb.CONTAINER_RUNNING
        log.wait(
            "restored from checkpoint",
            container=second.cid,
            checkpoint=committed.checkpoint_id,
        )
        assert log.find("checkpoint committed", container=first.cid, reason="stop")


def test_ctr_stop_checkpoints_and_new_container_resumes(
    containerd: Containerd, ctr: Ctr, new_id: NewId
) -> None:
    """The same story outside the CRI: `ctr run -d`, `ctr task kill -s SIGTERM`, remove,
    `ctr run` of a new container with the same label (scope: the containerd namespace)."""
    label = f"ctr-{uuid.uuid4().hex[:8]}"
    logs = containerd.base / "ctr-logs"
    logs.mkdir(exist_ok=True)
    log = ShimLog(containerd)

    def run(cid: str, out: Path) -> None:
        flags = ("-d", "--env", f"{ENV_LABEL}={label}", "--log-uri", f"file://{out}")
        ctr(
            *ctr.run_args(containerd.images.busybox, cid, "sh", "-c", counter_script(), flags=flags)
        )

    first, second = new_id("first"), new_id("second")
    out1, out2 = logs / f"{first}.log", logs / f"{second}.log"
    try:
        with EventStream(containerd.socket) as events:
            run(first, out1)
            wait_ticks(lambda: file_lines(out1), count=5)
            ctr("task", "kill", "-s", "SIGTERM", first)
            exited = events.wait_topic(TOPIC_EXIT, first, timeout=30)
            assert exited.field("exit_status") == 143, exited
            committed = events.wait_commit(first, timeout=COMMIT_TIMEOUT)
            assert (committed.field("scope"), committed.field("label")) == (CTR_NAMESPACE, label)
            ctr("task", "delete", first)
            ctr("containers", "delete", first)
            before = parse_ticks(file_lines(out1))
            assert before is not None
            assert "got-TERM" not in file_lines(out1)
            listed = entries(containerd.store, scope=CTR_NAMESPACE, label=label)
            assert [e.id for e in listed] == [committed.checkpoint_id]
            assert listed[0].metadata["containerId"] == first

            run(second, out2)
            outcome = events.wait_topic(TOPIC_RESTORE, second, timeout=30)
            assert outcome.field("outcome") == "restored", outcome
            assert outcome.checkpoint_id == committed.checkpoint_id
            after = wait_ticks(lambda: file_lines(out2), count=3)
            assert_continues(before, after, "ctr restore")
            res = ctr("task", "exec", "--exec-id", "probe", second, "sh", "-c", _PROBE)
            token, shm_token, count, deleted = res.stdout.split()
            assert token == shm_token == before.token
            assert int(count) >= after.first and deleted == "deleted"
            later = wait_ticks(lambda: file_lines(out2), count=len(after.values) + 5)
            assert_continues(before, later, "ctr restore, later")
            task = ctr.task(second)
            assert task is not None and task.status == "RUNNING", task
            log.wait("restored from checkpoint", container=second)
    finally:
        ctr.remove(first)
        ctr.remove(second)


def test_label_is_scoped_to_the_kubernetes_namespace(
    containerd: Containerd, cri: CriClient
) -> None:
    """Namespaces A and B use the same label: B never sees A's checkpoint (it starts
    cold, and its own checkpoint stays in B), while A restores A's."""
    label = f"shared-{uuid.uuid4().hex[:8]}"
    suffix = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"team-a-{suffix}", f"team-b-{suffix}"
    log = ShimLog(containerd)
    with EventStream(containerd.socket) as events, contextlib.ExitStack() as stack:
        a1 = start_app(stack, containerd, cri, label=label, namespace=ns_a)
        wait_ticks(a1.stdout, count=3)
        stop_app(cri, a1)
        ckpt_a = events.wait_commit(a1.cid, timeout=COMMIT_TIMEOUT)
        assert ckpt_a.field("scope") == ns_a
        tokens_a = parse_ticks(a1.stdout())
        assert tokens_a is not None

        b1 = start_app(stack, containerd, cri, label=label, namespace=ns_b)
        outcome_b = events.wait_topic(TOPIC_RESTORE, b1.cid, timeout=30)
        assert outcome_b.field("outcome") == "cold", outcome_b
        assert (outcome_b.field("scope"), outcome_b.checkpoint_id) == (ns_b, "")
        cold = log.wait("starting cold", container=b1.cid)
        assert (cold["scope"], cold["label"]) == (ns_b, label), cold
        ticks_b = wait_ticks(b1.stdout, count=3)
        assert ticks_b.token != tokens_a.token and ticks_b.first == 1, ticks_b
        stop_app(cri, b1)
        ckpt_b = events.wait_commit(b1.cid, timeout=COMMIT_TIMEOUT)
        assert ckpt_b.field("scope") == ns_b

        # B's checkpoint is newer than A's: A must still get its own.
        a2 = start_app(stack, containerd, cri, label=label, namespace=ns_a)
        outcome_a = events.wait_topic(TOPIC_RESTORE, a2.cid, timeout=30)
        assert outcome_a.field("outcome") == "restored", outcome_a
        assert outcome_a.checkpoint_id == ckpt_a.checkpoint_id
        assert_continues(tokens_a, wait_ticks(a2.stdout, count=3), "namespace A")

    in_a = entries(containerd.store, scope=ns_a, label=label)
    in_b = entries(containerd.store, scope=ns_b, label=label)
    assert [e.id for e in in_a] == [ckpt_a.checkpoint_id]
    assert [e.id for e in in_b] == [ckpt_b.checkpoint_id]


@pytest.mark.ctrd_versions("1.6", "2.1")  # ~25 s each: two 10 s periods. The timer and
# the leave-running dump are the shim's own; what touches containerd (the crash's exit,
# the restore at Create/Start) is covered on every version by the tests above.
def test_periodic_checkpoints_then_crash_resumes_from_the_last(
    containerd: Containerd, ctr: Ctr, new_id: NewId
) -> None:
    label = f"periodic-{uuid.uuid4().hex[:8]}"
    logs = containerd.base / "ctr-logs"
    logs.mkdir(exist_ok=True)
    crashed, resumed = new_id("crash"), new_id("resume")
    out1, out2 = logs / f"{crashed}.log", logs / f"{resumed}.log"
    flags = ("-d", "--env", f"{ENV_LABEL}={label}", "--env", f"{ENV_INTERVAL}=10s")
    try:
        with EventStream(containerd.socket) as events:
            ctr(
                *ctr.run_args(
                    containerd.images.busybox,
                    crashed,
                    "sh",
                    "-c",
                    counter_script(),
                    flags=(*flags, "--log-uri", f"file://{out1}"),
                )
            )

            def periodic(e: Event) -> bool:
                return (
                    e.topic == TOPIC_COMMITTED
                    and e.field("container_id") == crashed
                    and e.field("reason") == "periodic"
                )

            one = events.wait(periodic, timeout=25, what="the first periodic checkpoint")
            assert [e.id for e in entries(containerd.store, label=label)] == [one.checkpoint_id]
            two = events.wait(
                lambda e: periodic(e) and e is not one,
                timeout=25,
                what="the second periodic checkpoint",
            )
            listed = entries(containerd.store, label=label)
            assert [e.id for e in listed] == [
                two.checkpoint_id,
                one.checkpoint_id,
            ]
            assert all(e.metadata["reason"] == "periodic" for e in listed)
            # The count the newest checkpoint holds, from its own rootfs diff (captured
            # while the container was frozen for the dump).
            raw = rootfs_diff_file(containerd.store, listed[0], "/var/count")
            assert raw is not None, "the periodic checkpoint has no /var/count"
            at_checkpoint = int(raw)
            # Leave-running: the workload went on counting past both checkpoints.
            wait_ticks(lambda: file_lines(out1), count=at_checkpoint + 3)
            task = ctr.task(crashed)
            assert task is not None and task.status == "RUNNING"
            assert not events.of(TOPIC_FAILED, crashed)

            # A crash the shim cannot see coming: SIGKILL to the workload from outside.
            os.kill(task.pid, signal.SIGKILL)
            exited = events.wait_topic(TOPIC_EXIT, crashed, timeout=30)
            assert exited.field("exit_status") == 137
            at_crash = parse_ticks(file_lines(out1))
            assert at_crash is not None
            ctr("task", "delete", crashed)
            ctr("containers", "delete", crashed)
            assert [e.id for e in entries(containerd.store, label=label)] == [
                two.checkpoint_id,
                one.checkpoint_id,
            ], "a crash must not add or remove checkpoints"

            ctr(
                *ctr.run_args(
                    containerd.images.busybox,
                    resumed,
                    "sh",
                    "-c",
                    counter_script(),
                    flags=("-d", "--env", f"{ENV_LABEL}={label}", "--log-uri", f"file://{out2}"),
                )
            )
            outcome = events.wait_topic(TOPIC_RESTORE, resumed, timeout=30)
            assert outcome.field("outcome") == "restored"
            assert outcome.checkpoint_id == two.checkpoint_id
            after = wait_ticks(lambda: file_lines(out2), count=3)
            assert after.token == at_crash.token
            # Resumed from the last periodic checkpoint: above its count, below the
            # count at the crash (the ticks after the checkpoint are lost, as expected).
            assert at_checkpoint < after.first <= at_checkpoint + 2 < at_crash.last, (
                at_checkpoint,
                after.values[:3],
                at_crash.last,
            )
    finally:
        ctr.remove(crashed)
        ctr.remove(resumed)


def test_cri_stop_checkpoint_with_a_large_rootfs_diff(
    containerd: Containerd, cri: CriClient
) -> None:
    """A container that wrote 96 MiB to its rootfs: capturing the diff takes a moment
    after CRIU has ended the process. The exit is reported meanwhile, and the CRI plugin
    answers an exit with Delete(WithProcessKill), i.e. Kill(SIGKILL, all). That SIGKILL
    is for a process that is already gone; it must not abort the checkpoint that ended
    it, or the workload's state is lost although it was dumped."""
    label = f"bigdiff-{uuid.uuid4().hex[:8]}"
    kns = f"ns-{uuid.uuid4().hex[:6]}"
    big = "head -c 100663296 /dev/urandom > /var/big; echo big-written\n"
    script = counter_script(extra=big)
    with EventStream(containerd.socket) as events, contextlib.ExitStack() as stack:
        first = start_app(stack, containerd, cri, label=label, namespace=kns, script=script)
        wait_for(lambda: "big-written" in first.stdout(), timeout=30, what="the big file")
        wait_ticks(first.stdout, count=3)
        stop_app(cri, first)
        ckpt = events.wait_commit(first.cid, timeout=COMMIT_TIMEOUT)
        before = parse_ticks(first.stdout())
        assert before is not None
        listed = entries(containerd.store, scope=kns, label=label)
        assert [e.id for e in listed] == [ckpt.checkpoint_id]
        assert listed[0].metadata["rootfs_diff"]["bytes"] >= 96 << 20

        second = start_app(stack, containerd, cri, label=label, namespace=kns, script=script)
        outcome = events.wait_topic(TOPIC_RESTORE, second.cid, timeout=60)
        assert outcome.checkpoint_id == ckpt.checkpoint_id, outcome
        assert_continues(before, wait_ticks(second.stdout, count=3), "restore with a big diff")
        size = sh(cri, second.cid, "wc -c < /var/big").strip()
        assert size == str(96 << 20)


# -- CNI: a different network namespace and IP -----------------------------------------------


class HelloServer:
    """A TCP server on the host: greets every connection and keeps it open."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.peers: list[str] = []
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            self.peers.append(addr[0])
            self._conns.append(conn)
            with contextlib.suppress(OSError):
                conn.sendall(b"hello\n")

    def say(self, text: bytes) -> None:
        """Send `text` on every connection accepted so far."""
        for conn in self._conns:
            conn.sendall(text)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for conn in self._conns:
            conn.close()


@contextlib.contextmanager
def hello_server() -> Iterator[HelloServer]:
    server = HelloServer()
    try:
        yield server
    finally:
        server.close()


def _pod_ip(cri: CriClient, pod: Pod) -> str:
    return str(cri.pod_status(pod.id).status.network.ip)


def _sandbox_netns(cri: CriClient, pod: Pod) -> str:
    info = json.loads(cri.pod_status(pod.id, verbose=True).info["info"])
    return os.readlink(f"/proc/{int(info['pid'])}/ns/net")


def test_restore_into_a_pod_with_a_new_ip(containerd: Containerd, cri: CriClient) -> None:
    """CNI bridge pods: the first pod has IP X, the new one (another network namespace)
    IP Y; the process resumes there, in the new pod's network namespace."""
    label = f"cni-{uuid.uuid4().hex[:8]}"
    kns = f"ns-{uuid.uuid4().hex[:6]}"
    with EventStream(containerd.socket) as events, contextlib.ExitStack() as stack:
        first = start_app(stack, containerd, cri, label=label, namespace=kns, host_network=False)
        ip_x = _pod_ip(cri, first.pod)
        assert ipaddress.ip_address(ip_x) in ipaddress.ip_network(containerd.subnet)
        netns_x = _sandbox_netns(cri, first.pod)
        # Held open: a freed namespace's inode number is handed out again.
        info = json.loads(cri.pod_status(first.pod.id, verbose=True).info["info"])
        stack.callback(os.close, os.open(f"/proc/{int(info['pid'])}/ns/net", os.O_RDONLY))
        wait_ticks(first.stdout, count=3)
        stop_app(cri, first)
        ckpt = events.wait_commit(first.cid, timeout=COMMIT_TIMEOUT)
        before = parse_ticks(first.stdout())
        assert before is not None
        listed = entries(containerd.store, scope=kns, label=label)
        recorded = {a["address"] for a in listed[0].metadata["network"]["addresses"]}
        assert ip_x in recorded, recorded

        second = start_app(stack, containerd, cri, label=label, namespace=kns, host_network=False)
        ip_y = _pod_ip(cri, second.pod)
        assert ip_y != ip_x, "host-local IPAM gave the new pod the old IP"
        outcome = events.wait_topic(TOPIC_RESTORE, second.cid, timeout=30)
        assert outcome.field("outcome") == "restored", outcome
        assert outcome.checkpoint_id == ckpt.checkpoint_id
        assert_continues(before, wait_ticks(second.stdout, count=3), "restore into a new IP")
        files = probe(cri, second.cid)
        assert files.rootfs_token == files.shm_token == before.token and files.deleted
        pid = cri.container_pid(second.cid)
        netns_y = _sandbox_netns(cri, second.pod)
        assert netns_y != netns_x
        assert os.readlink(f"/proc/{pid}/ns/net") == netns_y
        assert f"inet {ip_y}/" in sh(cri, second.cid, "ip -4 addr show eth0")
        assert cri.container_status(second.cid).status.state == cri_pb.CONTAINER_RUNNING


def _get(ip: str, path: str) -> str:
    with socket.create_connection((ip, 8080), timeout=5) as conn:
        conn.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    head, _, body = reply.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.") and " 200 " in head.splitlines()[0], head
    return body


@pytest.mark.ctrd_versions("1.6", "2.1")
def test_http_server_in_a_pod_answers_at_its_new_ip(containerd: Containerd, cri: CriClient) -> None:
    """busybox httpd in a CNI pod, asked from the host at pod IP X; stopped by kubelet's
    pod deletion with a checkpoint; restored in a new pod with IP Y, the listening socket
    serves again at Y, the count continued."""
    label = f"httpd-{uuid.uuid4().hex[:8]}"
    kns = f"ns-{uuid.uuid4().hex[:6]}"
    script = counter_script(extra="httpd -f -p 8080 -h /var &\n")
    with EventStream(containerd.socket) as events, contextlib.ExitStack() as stack:
        first = start_app(
            stack, containerd, cri, label=label, namespace=kns, host_network=False, script=script
        )
        ip_x = _pod_ip(cri, first.pod)
        wait_ticks(first.stdout, count=3)
        assert int(_get(ip_x, "/count")) >= 3
        stop_app(cri, first)
        ckpt = events.wait_commit(first.cid, timeout=COMMIT_TIMEOUT)
        before = parse_ticks(first.stdout())
        assert before is not None

        second = start_app(
            stack, containerd, cri, label=label, namespace=kns, host_network=False, script=script
        )
        ip_y = _pod_ip(cri, second.pod)
        assert ip_y != ip_x
        restored = events.wait_topic(TOPIC_RESTORE, second.cid, timeout=30)
        assert restored.checkpoint_id == ckpt.checkpoint_id, restored
        assert_continues(before, wait_ticks(second.stdout, count=3), "restore of a pod server")
        served = int(_get(ip_y, "/count"))
        assert served > before.last, (served, before)


@pytest.mark.ctrd_versions("1.6", "2.1")
def test_tcp_connection_is_closed_cleanly_after_restore_into_a_new_ip(
    containerd: Containerd, cri: CriClient
) -> None:
    """The checkpoint holds a TCP connection established from pod IP X to a server on the
    host. It cannot survive the move to IP Y: the restore must close it cleanly (the
    client sees the connection end and exits) while the rest of the process resumes."""
    label = f"tcp-{uuid.uuid4().hex[:8]}"
    kns = f"ns-{uuid.uuid4().hex[:6]}"
    gateway = f"{containerd.subnet_prefix}.1"  # the bridge's address on the host
    with hello_server() as server:
        # The status is nc's own: a pipeline would wait for the sleep as well.
        tcp_client = (
            f"sleep 2147483647 | ( nc {gateway} {server.port} > /var/nc.out 2>/var/nc.err;"
            ' echo "nc-exit $?" > /var/nc.status ) &\n'
        )
        script = counter_script(extra=tcp_client)
        with EventStream(containerd.socket) as events, contextlib.ExitStack() as stack:
            first = start_app(
                stack,
                containerd,
                cri,
                label=label,
                namespace=kns,
                host_network=False,
                script=script,
            )
            ip_x = _pod_ip(cri, first.pod)
            wait_for(
                lambda: sh(cri, first.cid, "cat /var/nc.out 2>/dev/null; true") == "hello\n",
                timeout=15,
                what="the container's TCP connection to the host",
            )
            assert server.peers == [ip_x]
            wait_ticks(first.stdout, count=3)
            cri.stop_container(first.cid, timeout=30)
            # No fallback: a dump CRIU cannot do fails here, with CRIU's reason.
            ckpt = events.wait_commit(first.cid, timeout=COMMIT_TIMEOUT)
            status = cri.container_status(first.cid).status
            assert status.exit_code == 143 and "got-TERM" not in first.stdout(), status
            before = parse_ticks(first.stdout())
            assert before is not None
            cri.remove_container(first.cid)
            cri.stop_pod(first.pod.id)
            cri.remove_pod(first.pod.id)

            second = start_app(
                stack,
                containerd,
                cri,
                label=label,
                namespace=kns,
                host_network=False,
                script=script,
            )
            assert _pod_ip(cri, second.pod) != ip_x
            outcome = events.wait_topic(TOPIC_RESTORE, second.cid, timeout=30)
            assert outcome.field("outcome") == "restored", outcome
            assert outcome.checkpoint_id == ckpt.checkpoint_id
            assert_continues(before, wait_ticks(second.stdout, count=3), "restore with TCP")
            # The client saw its connection end instead of hanging on an address that no
            # longer exists; it does not reconnect by itself.
            status_line = wait_for(
                lambda: sh(cri, second.cid, "cat /var/nc.status 2>/dev/null; true").strip(),
                timeout=15,
                what="the restored TCP client to see its connection closed",
            )
            assert status_line.startswith("nc-exit"), status_line
            assert server.peers == [ip_x]
            assert cri.container_status(second.cid).status.state == cri_pb.CONTAINER_RUNNING


@pytest.mark.ctrd_versions("1.6", "2.1")
def test_tcp_connection_survives_a_restart_in_the_same_pod(
    containerd: Containerd, cri: CriClient
) -> None:
    """The container is stopped (checkpointed) and a new one of the label is started in
    the SAME pod (kubelet restarting a container): the pod IP is kept, so the TCP
    connection to a server on the host lives on. The server saw no end of it, and what
    it sends after the restore reaches the restored client."""
    label = f"tcpkeep-{uuid.uuid4().hex[:8]}"
    kns = f"ns-{uuid.uuid4().hex[:6]}"
    gateway = f"{containerd.subnet_prefix}.1"
    log_dir = containerd.pod_logs / uuid.uuid4().hex[:12]
    with hello_server() as server:
        script = counter_script(
            extra=f"sleep 2147483647 | nc {gateway} {server.port} > /var/nc.out &\n"
        )
        envs = {ENV_LABEL: label}
        with (
            EventStream(containerd.socket) as events,
            cri.pod("counter", log_dir, host_network=False, namespace=kns) as pod,
        ):
            first = cri.create_container(
                pod, "app", containerd.images.busybox, ["sh", "-c", script], envs=envs
            )
            cri.start_container(first)
            wait_for(
                lambda: sh(cri, first, "cat /var/nc.out 2>/dev/null; true") == "hello\n",
                timeout=15,
                what="the container's TCP connection to the host",
            )
            cri.stop_container(first, timeout=30)
            ckpt = events.wait_commit(first, timeout=COMMIT_TIMEOUT)
            assert cri.container_status(first).status.exit_code == 143
            cri.remove_container(first)

            second = cri.create_container(
                pod, "app", containerd.images.busybox, ["sh", "-c", script], envs=envs
            )
            cri.start_container(second)
            outcome = events.wait_topic(TOPIC_RESTORE, second, timeout=30)
            assert outcome.field("outcome") == "restored", outcome
            assert outcome.checkpoint_id == ckpt.checkpoint_id
            server.say(b"again\n")
            wait_for(
                lambda: sh(cri, second, "cat /var/nc.out") == "hello\nagain\n",
                timeout=15,
                what="the server's words after the restore to reach the restored client",
            )
            assert len(server.peers) == 1, server.peers  # no reconnection


@pytest.fixture(scope="module")
def many_sockets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fixtures/many_sockets.c, built static (the test image has only busybox)."""
    out = tmp_path_factory.mktemp("many") / "many_sockets"
    source = Path(__file__).parent / "fixtures" / "many_sockets.c"
    subprocess.run(["gcc", "-static", "-O2", "-o", str(out), str(source)], check=True)
    return out


@pytest.mark.ctrd_versions("1.6", "2.1")
def test_a_process_with_thousands_of_sockets_moves_to_a_new_pod(
    containerd: Containerd, cri: CriClient, many_sockets: Path
) -> None:
    """One process holding 3001 TCP sockets (1500 connections to itself on 127.0.0.1,
    and the listener), exchanging data on all of them: checkpointed on pod deletion,
    restored in a new pod (a new network namespace), every connection still carries
    data and its count goes on."""
    label = f"many-{uuid.uuid4().hex[:8]}"
    kns = f"ns-{uuid.uuid4().hex[:6]}"
    envs = {ENV_LABEL: label}
    command = ["/many_sockets", str(MANY_PAIRS)]
    mounts = [(str(many_sockets), "/many_sockets")]
    with EventStream(containerd.socket) as events, contextlib.ExitStack() as stack:

        def start() -> App:
            log_dir = containerd.pod_logs / uuid.uuid4().hex[:12]
            pod = stack.enter_context(cri.pod("many", log_dir, host_network=False, namespace=kns))
            cid = cri.create_container(
                pod, "app", containerd.images.busybox, command, envs=envs, mounts=mounts
            )
            cri.start_container(cid)
            return App(pod, cid, log_dir / "app.log")

        def counts(app: App) -> list[tuple[int, int]]:
            found = [re.fullmatch(r"pairs (\d+) ok (\d+)", line) for line in app.stdout()]
            return [(int(m.group(1)), int(m.group(2))) for m in found if m]

        first = start()
        wait_for(lambda: len(counts(first)) >= 3, timeout=60, what="the sockets to be up")
        assert all(ok == MANY_PAIRS for _, ok in counts(first)), counts(first)[-3:]
        stop_app(cri, first)
        ckpt = events.wait_commit(first.cid, timeout=COMMIT_TIMEOUT)
        last = counts(first)[-1][0]

        second = start()
        restored_from_cri = events.wait_topic(TOPIC_RESTORE, second.cid, timeout=120)
        assert restored_from_cri.checkpoint_id == ckpt.checkpoint_id, restored_from_cri
        after = wait_for(
            lambda: counts(second)[:3] if len(counts(second)) >= 3 else None,
            timeout=60,
            what="the restored process's rounds",
        )
        assert after[0][0] == last + 1, (last, after)
        assert all(ok == MANY_PAIRS for _, ok in after), after


# -- who never takes part ------------------------------------------------------------------


PLAIN = (
    "trap 'echo plain-TERM; exit 0' TERM; "
    "echo plain-start; while :; do echo tick > /var/plain; sleep 0.2; done"
)


def test_pause_and_unlabelled_containers_are_never_checkpointed(
    containerd: Containerd, cri: CriClient
) -> None:
    """A pod with a labelled and an unlabelled container: only the labelled one is
    checkpointed and restored; the pause container and the unlabelled one are never
    checkpointed (not even when the pause gets a SIGTERM through containerd), leave no
    store entries and no cedana events, and the unlabelled one stops as with runc (its
    own SIGTERM handler, exit 0)."""
    label = f"pause-{uuid.uuid4().hex[:8]}"
    kns = f"ns-{uuid.uuid4().hex[:6]}"
    k8s = containerd.ctr(CRI_NAMESPACE)
    log = ShimLog(containerd)
    with EventStream(containerd.socket) as events, contextlib.ExitStack() as stack:
        app = start_app(stack, containerd, cri, label=label, namespace=kns)
        plain = cri.create_container(
            app.pod, "plain", containerd.images.busybox, ["sh", "-c", PLAIN]
        )
        cri.start_container(plain)
        plain_log = app.log.parent / "plain.log"
        wait_for(lambda: "plain-start" in cri_stdout(plain_log), timeout=10, what="plain start")
        wait_ticks(app.stdout, count=3)

        # SIGTERM to the pause container through containerd (what a stop of it would
        # send): the shim must just deliver it (pause, as pid 1 with no handler, ignores it).
        sandbox_pid = json.loads(cri.pod_status(app.pod.id, verbose=True).info["info"])["pid"]
        k8s("task", "kill", "-s", "SIGTERM", app.pod.id)
        assert procs.pid_alive(int(sandbox_pid))

        cri.stop_container(plain, timeout=30)
        st = cri.container_status(plain).status
        assert (st.state, st.exit_code) == (cri_pb.CONTAINER_EXITED, 0), st
        assert "plain-TERM" in cri_stdout(plain_log)
        cri.remove_container(plain)
        stop_app(cri, app)  # StopPodSandbox kills the pause container too
        ckpt = events.wait_commit(app.cid, timeout=COMMIT_TIMEOUT)

        second = start_app(stack, containerd, cri, label=label, namespace=kns)
        outcome = events.wait_topic(TOPIC_RESTORE, second.cid, timeout=30)
        assert outcome.checkpoint_id == ckpt.checkpoint_id
        wait_ticks(second.stdout, count=3)
        # The restored app joined the new sandbox (started before it), not the old one.
        new_sandbox = json.loads(cri.pod_status(second.pod.id, verbose=True).info["info"])
        pid = cri.container_pid(second.cid)
        for ns in ("ipc", "uts"):
            assert os.readlink(f"/proc/{pid}/ns/{ns}") == os.readlink(
                f"/proc/{new_sandbox['pid']}/ns/{ns}"
            ), ns

        bystanders = {app.pod.id, plain, second.pod.id}
        cedana_topics = (TOPIC_COMMITTED, TOPIC_FAILED, TOPIC_RESTORE)
        touched = [
            (e.topic, e.field("container_id"))
            for e in events.events(lambda e: e.topic in cedana_topics)
            if e.field("container_id") in bystanders
        ]
        assert not touched, f"cedana events for the pause/unlabelled containers: {touched}"
    cedana_lines = {"starting cold", "restored from checkpoint", "checkpoint committed"}
    for cid in bystanders:
        said = [m for m in log.about(cid) if m in cedana_lines or "checkpoint" in m]
        assert not said, f"the shim treated {cid} as opted in: {said}"
    listed = entries(containerd.store, scope=kns)
    assert [e.id for e in listed] == [ckpt.checkpoint_id]
    assert {e.metadata["containerId"] for e in listed} == {app.cid}
    assert {e.metadata["container"] for e in listed} == {"app"}
    everywhere = entries(containerd.store)
    assert not [e.id for e in everywhere if e.metadata.get("containerId") in bystanders]

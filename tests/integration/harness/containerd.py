"""A private containerd process: its own root, state, sockets, CNI network and log.

The instance registers two runtimes, `runc` (containerd's own shim) and `cedana`
(ours, registered exactly as `cedana node install` registers it), so the same tests
can drive either one.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from cedana_shim.node import registration

from . import procs
from .config import (
    CEDANA,
    CNI_BIN_DIR,
    CRI_NAMESPACE,
    CRIU,
    SHIM_BIN_DIR,
    ContainerdVersion,
    Runtime,
)
from .cri import CGROUP_PARENT_ROOT, CriClient
from .ctr import Ctr
from .images import TestImages
from .util import slower, wait_for

RUNC_STATE_ROOT = Path("/run/containerd/runc")
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


class ContainerdError(AssertionError):
    pass


def _toml_str(value: str | Path) -> str:
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


class Containerd:
    """One containerd daemon under `base`. `start()`, `stop()` and `restart()` keep the
    same directories, so running containers survive a restart as on a real node."""

    def __init__(
        self,
        version: ContainerdVersion,
        runtime: Runtime,
        base: Path,
        images: TestImages,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.version = version
        self.runtime = runtime
        # Added last to containerd's environment, so its shims inherit them (node config
        # `CEDANA_<KEY>`, or e.g. PYTHONPATH with CEDANA_FORKSERVER=0); a PATH goes in
        # front of the harness's own (a wrapper shadowing a tool). A change takes effect
        # at the next start().
        self.extra_env: dict[str, str] = dict(extra_env or {})
        self.images = images
        self.base = base
        self.root = base / "root"
        self.state = base / "state"
        self.socket = base / "c.sock"
        self.config_path = base / "config.toml"
        self.log_path = base / "containerd.log"
        self.cni_conf_dir = base / "cni-conf"
        self.cni_data_dir = base / "cni-ipam"
        self.pod_logs = base / "pod-logs"
        # The cedana checkpoint store of this instance's shims (the shim reads
        # CEDANA_STORE_PATH from containerd's environment).
        self.store = base / "checkpoints"
        self.shim_log_file = base / "shim.log"
        # The node config the containerd 1.6 form's ConfigPath names: empty, the
        # settings come from CEDANA_* in the environment. (From 1.7 the shim reads
        # the default path, absent here.)
        self.node_config = base / "shim.toml"
        suffix = uuid.uuid4().hex[:8]
        self.bridge = f"cdn{suffix}"
        # A random /24 per instance: several containerds (and other suites) may run on
        # one host, each with its own bridge.
        self.subnet_prefix = f"10.{random.randint(200, 239)}.{random.randint(0, 255)}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        # Shim socket paths seen in bundles: a SIGKILLed shim leaves its socket file
        # behind (the runc shim too), and the bundle that named it is gone by teardown.
        self.seen_shim_sockets: set[str] = set()
        self._write_config()

    # -- configuration ----------------------------------------------------------------

    @property
    def subnet(self) -> str:
        return f"{self.subnet_prefix}.0/24"

    @property
    def task_state_dir(self) -> Path:
        return self.state / "io.containerd.runtime.v2.task"

    def bundle(self, namespace: str, cid: str) -> Path:
        return self.task_state_dir / namespace / cid

    def _write_config(self) -> None:
        for d in (self.root, self.state, self.cni_conf_dir, self.cni_data_dir, self.pod_logs):
            d.mkdir(parents=True, exist_ok=True)
        self.base.chmod(0o711)
        # containerd's CRI adds the loopback interface itself (with the `loopback`
        # plugin from the bin dir); the conflist only describes eth0.
        conflist = {
            "cniVersion": "1.0.0",
            "name": f"cedana-itest-{self.bridge}",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.subnet}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.cni_data_dir),
                    },
                }
            ],
        }
        (self.cni_conf_dir / "10-cedana-itest.conflist").write_text(json.dumps(conflist))
        self.node_config.write_text("# settings: CEDANA_* in containerd's environment\n")
        render = self._config_v3 if self.version.config_version == 3 else self._config_v2
        self.config_path.write_text(render())

    def _common_header(self, version: int) -> str:
        return f"""version = {version}
root = {_toml_str(self.root)}
state = {_toml_str(self.state)}

[grpc]
  address = {_toml_str(self.socket)}

[ttrpc]
  address = {_toml_str(str(self.socket) + ".ttrpc")}

[debug]
  level = "debug"
"""

    def _runtime_tables(self, prefix: str) -> str:
        # The cedana tables come last, whole, as the installer renders them.
        return f"""
  [{prefix}.containerd]
    default_runtime_name = "runc"
    [{prefix}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
"""

    def cedana_runtime_path(self) -> str | None:
        """The `runtime_path` the cedana handler is registered with; None on
        containerd 1.6 (the shim's own runtime type, found on PATH)."""
        version = self.version
        if not registration.honours_runtime_path(version.major_minor, version.config_version):
            return None
        return str(CEDANA.shim_path(version))

    def _cedana_tables(self) -> str:
        return "\n" + registration.render_tables(
            self.version.config_version, self.cedana_runtime_path(), str(self.node_config)
        )

    def _config_v2(self) -> str:
        cri = '"io.containerd.grpc.v1.cri"'
        prefix = f"plugins.{cri}"
        text = (
            self._common_header(2)
            + f"""
[plugins."io.containerd.internal.v1.opt"]
  path = {_toml_str(self.base / "opt")}

[{prefix}]
  # This VM withholds CAP_SYS_RESOURCE: without this every sandbox fails to start.
  restrict_oom_score_adj = true
  sandbox_image = {_toml_str(self.images.pause)}
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [{prefix}.cni]
    bin_dir = {_toml_str(CNI_BIN_DIR)}
    conf_dir = {_toml_str(self.cni_conf_dir)}
"""
            + self._runtime_tables(prefix)
        )
        if self.version.major_minor >= (1, 7):
            # NRI's socket is host-global (/var/run/nri/nri.sock).
            text += '\n[plugins."io.containerd.nri.v1.nri"]\n  disable = true\n'
        return text + self._cedana_tables()

    def _config_v3(self) -> str:
        runtime = "plugins.'io.containerd.cri.v1.runtime'"
        return (
            self._common_header(3)
            + f"""
[plugins.'io.containerd.internal.v1.opt']
  path = {_toml_str(self.base / "opt")}

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = {_toml_str(self.images.pause)}

[{runtime}]
  # This VM withholds CAP_SYS_RESOURCE: without this every sandbox fails to start.
  restrict_oom_score_adj = true
  [{runtime}.cni]
    bin_dirs = [{_toml_str(CNI_BIN_DIR)}]
    conf_dir = {_toml_str(self.cni_conf_dir)}
"""
            + self._runtime_tables(runtime)
            + """
[plugins.'io.containerd.nri.v1.nri']
  disable = true
"""
            + self._cedana_tables()
        )

    def _env(self) -> dict[str, str]:
        # The matching version's runc shim must win the PATH lookup over /usr/bin's
        # 1.6 one; the venv provides containerd-shim-cedana-v2; /usr/local/sbin carries
        # CRIU >= 4.1 ahead of any distribution criu.
        path = [
            str(self.version.bin_dir),
            str(SHIM_BIN_DIR),
            str(CRIU.parent),
            "/usr/local/bin",
            "/usr/sbin",
            "/usr/bin",
            "/sbin",
            "/bin",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CONTAINERD_")}
        env["PATH"] = ":".join(dict.fromkeys(path))
        env["CEDANA_STORE_PATH"] = str(self.store)
        # The shims' own log file (node config log_file), per instance.
        env["CEDANA_LOG_FILE"] = str(self.shim_log_file)
        # The warm fork server must not outlive the suite by an hour.
        env.setdefault("CEDANA_FORKSERVER_IDLE", "120")
        env.update(self.extra_env)
        if "PATH" in self.extra_env:
            env["PATH"] = f"{self.extra_env['PATH']}:{':'.join(dict.fromkeys(path))}"
        return env

    # -- lifecycle --------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 20) -> None:
        if self.running:
            raise ContainerdError("containerd already running")
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        with open(self.log_path, "ab") as log:
            log.write(f"\n==== harness: starting containerd (start #{self.starts + 1})\n".encode())
            log.flush()
            # Own session: a test's signals never reach it, and it outlives nothing.
            self.proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
                start_new_session=True,
            )
        self.starts += 1
        timeout *= slower()
        deadline = time.monotonic() + timeout
        while not self._socket_answers():
            if not self.running:
                raise ContainerdError(
                    f"containerd {self.version.full} exited with {self.proc.returncode} "
                    f"during startup:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ContainerdError(
                    f"containerd {self.version.full} socket not ready after {timeout}s:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.02)
        self._check_plugins()

    def _command(self) -> list[str]:
        return [str(self.version.containerd), "--config", str(self.config_path)]

    def _socket_answers(self) -> bool:
        if not self.socket.exists():
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(str(self.socket))
            except OSError:
                return False
        return True

    def _check_plugins(self) -> None:
        """A plugin that fails to load (a config key wrong for this version, a missing
        binary) leaves containerd up but half-working: fail loudly here instead."""
        required = {
            ("io.containerd.grpc.v1", "cri"),
            ("io.containerd.snapshotter.v1", "overlayfs"),
            ("io.containerd.runtime.v2", "task"),
        }
        if self.version.major_minor >= (2, 0):
            required |= {("io.containerd.cri.v1", "runtime"), ("io.containerd.cri.v1", "images")}
        status = {}
        for line in self.ctr("default")("plugins", "ls").stdout.splitlines()[1:]:
            cols = line.split()
            if len(cols) >= 4:
                status[(cols[0], cols[1])] = cols[-1]
        broken = {
            f"{t} {i}: {status.get((t, i), 'missing')}"
            for t, i in required
            if status.get((t, i)) != "ok"
        }
        if broken:
            raise ContainerdError(
                f"containerd {self.version.full} plugins not ok: {sorted(broken)}\n"
                + self.log_tail()
            )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def restart(self, sig: int = signal.SIGTERM) -> None:
        """Stop (SIGTERM, or SIGKILL for a crash) and start again on the same dirs."""
        self.stop(sig)
        self.start()

    # -- clients ----------------------------------------------------------------------

    def ctr(self, namespace: str) -> Ctr:
        return Ctr(
            binary=self.version.ctr,
            address=self.socket,
            namespace=namespace,
            runtime_type=self.runtime.runtime_type,
        )

    def cri(self) -> CriClient:
        client = CriClient(self.socket, self.runtime.handler)
        client.wait_ready()
        return client

    def import_images(self, namespace: str) -> None:
        ctr = self.ctr(namespace)
        ctr("images", "import", str(self.images.archive), timeout=120)
        names = ctr("images", "ls", "-q").stdout.split()
        missing = {self.images.busybox, self.images.pause} - set(names)
        if missing:
            raise ContainerdError(f"images missing after import into {namespace}: {missing}")

    def shims(self, *, daemons_only: bool = True) -> list[procs.ShimProcess]:
        """Shim processes whose command line names this containerd (-address). The
        cedana shim's daemons, forked from its template process, rewrite their command
        line to containerd's usual one; `shim_daemons()` finds daemons by the socket
        they serve instead."""
        return procs.shim_processes(address=str(self.socket), daemons_only=daemons_only)

    def shim_address(self, namespace: str, cid: str) -> str | None:
        """The ttrpc address containerd dials for this task: the bundle's `address`
        file (written by the shim's `start`) or 2.x's `bootstrap.json`."""
        bundle = self.bundle(namespace, cid)
        address: str | None = None
        with contextlib.suppress(OSError):
            address = (bundle / "address").read_text().strip()
        if not address:
            with contextlib.suppress(OSError, ValueError, KeyError):
                address = str(json.loads((bundle / "bootstrap.json").read_text())["address"])
        if address and address.startswith("unix:///"):
            self.seen_shim_sockets.add(address.removeprefix("unix://"))
        return address or None

    def shim_pids(self, namespace: str, cid: str) -> set[int]:
        """Processes serving the task's shim socket (exactly one for a healthy shim)."""
        address = self.shim_address(namespace, cid)
        pids = procs.serving_pids(address) if address else set()
        for pid in pids:
            # e.g. the debug socket a 2.x runc shim opens under -debug
            self.seen_shim_sockets |= procs.listening_unix_paths(pid)
        return pids

    def shim_daemons(self) -> dict[int, set[tuple[str, str]]]:
        """Every live shim daemon of this containerd -> the (namespace, id) tasks whose
        bundles point at it."""
        daemons: dict[int, set[tuple[str, str]]] = {}
        for bundle in self.task_state_dir.glob("*/*"):
            ns, cid = bundle.parent.name, bundle.name
            for pid in self.shim_pids(ns, cid):
                daemons.setdefault(pid, set()).add((ns, cid))
        return daemons

    # -- logs -------------------------------------------------------------------------

    def log_offset(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def log_since(self, offset: int, limit: int = 200_000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return ""
        if len(data) > limit:
            data = b"[... earlier lines cut ...]\n" + data[-limit:]
        return data.decode(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_since(0).splitlines()[-lines:])

    # -- teardown ---------------------------------------------------------------------

    def cleanup(self, *, keep_base: bool = False, check: bool = True) -> list[str]:
        """Remove everything this instance created, even after failures; returns notes
        about what had to be forced (useful in a report, never raised).

        With `check`, raises ContainerdError once everything is removed if the shims
        left a `criu-root` mount in runc's state dir (a runc killed mid-restore leaves
        it; the shim must unmount it): the suite fails if that comes back."""
        notes: list[str] = []
        # Found through the bundles, which containerd removes along with the tasks.
        daemons = set(self.shim_daemons())
        if self.running:
            self._api_cleanup(notes)
        daemons |= set(self.shim_daemons())
        self.stop()
        # Before the harness kills anything itself: what is left now, the shims left.
        leaked = procs.criu_root_mounts(RUNC_STATE_ROOT, self.base)
        self._sweep_processes(notes, daemons)
        self._sweep_criu_roots(notes)
        self._sweep_runc_state(notes)
        self._sweep_mounts(notes)
        self._sweep_network()
        self._sweep_cgroups()
        if not keep_base:
            subprocess.run(["rm", "-rf", "--one-file-system", str(self.base)], check=False)
        if check and leaked:
            raise ContainerdError(
                f"containerd {self.version.full}: the shims left runc's criu-root mounted "
                f"(unmounted now): {', '.join(leaked)}"
            )
        return notes

    def _api_cleanup(self, notes: list[str]) -> None:
        deadline = time.monotonic() + 30
        try:
            client = CriClient(self.socket, self.runtime.handler)
            try:
                client.remove_all_pods()
            finally:
                client.close()
        except Exception as exc:
            notes.append(f"CRI cleanup: {exc!r}")
        try:
            namespaces = self.ctr("default")("namespaces", "ls", "-q", timeout=10).stdout.split()
        except Exception as exc:
            notes.append(f"ctr namespaces: {exc!r}")
            return
        for ns in namespaces:
            ctr = self.ctr(ns)
            try:
                ids = ctr.containers()
            except Exception as exc:
                notes.append(f"ctr -n {ns} containers: {exc!r}")
                continue
            for cid in ids:
                if time.monotonic() > deadline:
                    notes.append("API cleanup ran out of time")
                    return
                if ns != CRI_NAMESPACE:
                    notes.append(f"left behind: container {ns}/{cid}")
                ctr.remove(cid)

    def _sweep_processes(self, notes: list[str], daemons: set[int]) -> None:
        shim_pids = daemons | {s.pid for s in self.shims(daemons_only=False)}
        # A shim whose tasks were all deleted exits by itself shortly after; only the
        # ones still up after a grace period are forced (and reported).
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not any(procs.pid_alive(p) for p in shim_pids), timeout=3)
        shim_pids = {p for p in shim_pids if procs.pid_alive(p)}
        if not shim_pids:
            return
        victims = procs.descendants(shim_pids) | shim_pids
        notes.append(
            f"killed {len(shim_pids)} shim(s) and {len(victims) - len(shim_pids)} "
            "container processes still running at teardown"
        )
        for pid in victims:
            procs.kill_quietly(pid, signal.SIGKILL)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not any(procs.pid_alive(p) for p in victims), timeout=5)

    def _sweep_runc_state(self, notes: list[str]) -> None:
        """runc's state lives in a host-global root; delete what points at our bundles."""
        if not RUNC_STATE_ROOT.is_dir():
            return
        prefix = str(self.state) + "/"
        for root in RUNC_STATE_ROOT.iterdir():
            proc = subprocess.run(
                ["runc", "--root", str(root), "list", "--format", "json"],
                capture_output=True,
                text=True,
                check=False,
                timeout=20,
            )
            if proc.returncode != 0:
                continue
            for entry in json.loads(proc.stdout or "null") or []:
                if str(entry.get("bundle", "")).startswith(prefix):
                    notes.append(f"runc delete --force {entry['id']} (root {root})")
                    subprocess.run(
                        ["runc", "--root", str(root), "delete", "--force", entry["id"]],
                        capture_output=True,
                        check=False,
                        timeout=20,
                    )
        # Sockets of shims that were killed rather than shut down.
        for bundle in self.task_state_dir.glob("*/*"):
            self.shim_address(bundle.parent.name, bundle.name)
        for path in self.seen_shim_sockets:
            if not procs.unix_listener_inodes(path):
                with contextlib.suppress(OSError):
                    Path(path).unlink()

    def _sweep_criu_roots(self, notes: list[str]) -> None:
        """Before `runc delete`, which would remove the state dir through the mount."""
        for point in procs.criu_root_mounts(RUNC_STATE_ROOT, self.base):
            if _libc.umount2(point.encode(), _MNT_DETACH) != 0:
                notes.append(f"umount {point}: errno {ctypes.get_errno()}")
                continue
            notes.append(f"unmounted {point}")
            with contextlib.suppress(OSError):
                os.rmdir(point)
                os.rmdir(os.path.dirname(point))  # a restore that never wrote its state

    def _sweep_mounts(self, notes: list[str]) -> None:
        for point in procs.mounts_under(self.base):
            if _libc.umount2(point.encode(), _MNT_DETACH) != 0:
                notes.append(f"umount {point}: errno {ctypes.get_errno()}")

    def _sweep_network(self) -> None:
        # The bridge is created by the first CNI pod and outlives the pods.
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)

    def _sweep_cgroups(self) -> None:
        """Empty cgroup directories left by runc's parents (namespace/pod level)."""
        tops = [CGROUP_PARENT_ROOT.strip("/")] + [
            ns.name for ns in self.task_state_dir.glob("*") if ns.name != CRI_NAMESPACE
        ]
        for controller in Path("/sys/fs/cgroup").iterdir():
            for top in tops:
                base = controller / top
                if not base.is_dir():
                    continue
                for dirpath, _dirs, _files in sorted(
                    os.walk(base), key=lambda t: t[0].count("/"), reverse=True
                ):
                    with contextlib.suppress(OSError):
                        os.rmdir(dirpath)


def make_containerd(
    version: ContainerdVersion,
    runtime: Runtime,
    images: TestImages,
    parent: Path,
    namespaces: tuple[str, ...],
    extra_env: Mapping[str, str] | None = None,
    factory: type[Containerd] = Containerd,
) -> Containerd:
    """Create, start and load images into a containerd; on any failure, clean up and
    re-raise (a fixture that fails half-way must not leak a daemon). `extra_env` is
    added to containerd's environment (see `Containerd.extra_env`); `factory` is the
    class made (tests/vm registers the handler with SystemdCgroup)."""
    for binary in (version.containerd, version.ctr, version.runc_shim, CRIU):
        if not os.access(binary, os.X_OK):
            raise ContainerdError(f"{binary} missing or not executable: run `make setup`")
    shim = runtime.shim_path(version)
    if not os.access(shim, os.X_OK):
        raise ContainerdError(
            f"runtime {runtime.handler}: shim {shim} missing (pip install -e . in the venv?)"
        )
    parent.mkdir(parents=True, exist_ok=True)
    base = Path(
        subprocess.run(
            ["mktemp", "-d", "-p", str(parent), f"{version.id}-XXXX"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    instance = factory(version, runtime, base, images, extra_env)
    try:
        instance.start()
        for ns in namespaces:
            instance.import_images(ns)
    except BaseException:
        instance.cleanup(keep_base=True, check=False)
        raise
    return instance

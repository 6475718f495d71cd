"""The host's filesystem seen from the installer, and every file the installer owns.

``HostRoot`` maps host paths (what containerd and the shim will see) into the
installer's view (``--host-root``, ``/host`` in the DaemonSet), resolving symlinks
the way the host would (an absolute link target is relative to the host root, not
to the installer's container), and runs host binaries (chroot first, so a
dynamically linked binary finds the host's libraries).

``Managed`` writes files and symlinks and remembers, in the install state, what was
there before (a byte-exact backup of a file, the target of a link, or nothing), so
that uninstall can put it back exactly, and only when nobody changed it since.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

STATE_DIR = "/var/lib/cedana/node"
STATE_FILE = f"{STATE_DIR}/state.json"
_MAX_LINKS = 40


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class HostRoot:
    def __init__(self, root: str = "/") -> None:
        self.root = os.path.abspath(root)

    @property
    def is_real(self) -> bool:
        return self.root == "/"

    def __str__(self) -> str:
        return self.root

    def path(self, host_path: str, *, follow_last: bool = True) -> str:
        """Where ``host_path`` is in the installer's view, links resolved inside the
        host root. With ``follow_last=False`` a final symlink is not followed (for
        files the installer replaces or removes)."""
        if not host_path.startswith("/"):
            raise ValueError(f"host path {host_path!r} is not absolute")
        if self.is_real:
            return os.path.realpath(host_path) if follow_last else _real_parent(host_path)
        pending = [p for p in host_path.split("/") if p]
        resolved: list[str] = []
        hops = 0
        while pending:
            part = pending.pop(0)
            if part == ".":
                continue
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            here = os.path.join(self.root, *resolved, part)
            if (pending or follow_last) and os.path.islink(here):
                hops += 1
                if hops > _MAX_LINKS:
                    raise OSError(errno.ELOOP, "too many levels of symbolic links", host_path)
                target = os.readlink(here)
                if target.startswith("/"):
                    resolved = []
                pending = [p for p in target.split("/") if p] + pending
                continue
            resolved.append(part)
        return os.path.join(self.root, *resolved)

    def display(self, host_path: str) -> str:
        """A host path as a person would look for it from the installer's side."""
        return host_path if self.is_real else os.path.join(self.root, host_path.lstrip("/"))

    def run(
        self, argv: Sequence[str], *, timeout: float = 60, input: bytes | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        """Run a host binary (``argv[0]`` is a host path). Inside the host root first
        (chroot: the host's loader and libraries); where that cannot work (not root,
        or a root without a loader, as in tests) the binary runs directly."""
        if not self.is_real and os.geteuid() == 0:
            root = self.root

            def enter() -> None:
                os.chroot(root)
                os.chdir("/")

            with contextlib.suppress(OSError, subprocess.SubprocessError):
                return subprocess.run(
                    list(argv),
                    input=input,
                    capture_output=True,
                    timeout=timeout,
                    preexec_fn=enter,
                    check=False,
                )
        return subprocess.run(
            [self.path(argv[0]), *argv[1:]],
            input=input,
            capture_output=True,
            timeout=timeout,
            check=False,
        )


def _real_parent(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(os.path.realpath(head), tail)


def atomic_write(path: str, data: bytes, mode: int = 0o644, uid: int = -1, gid: int = -1) -> None:
    """Replace ``path`` so that a reader (containerd) never sees a half-written file."""
    tmp = f"{path}.cedana-tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if uid != -1 or gid != -1:
            os.chown(tmp, uid, gid)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


Kind = Literal["absent", "file", "symlink"]


@dataclass(frozen=True)
class Observed:
    kind: Kind
    data: bytes = b""
    target: str = ""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0


def observe(path: str) -> Observed:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Observed("absent")
    if os.path.islink(path):
        return Observed("symlink", target=os.readlink(path), uid=st.st_uid, gid=st.st_gid)
    if not os.path.isfile(path):
        raise OSError(errno.EISDIR, "not a regular file or symlink: refusing to replace it", path)
    with open(path, "rb") as f:
        data = f.read()
    return Observed("file", data, mode=st.st_mode & 0o7777, uid=st.st_uid, gid=st.st_gid)


class InstallState:
    """What install changed on the host, persisted as JSON under the host root."""

    def __init__(self, host: HostRoot) -> None:
        self.host = host
        self.file = host.path(STATE_FILE)
        self.data: dict[str, Any] = {"version": 1, "files": {}, "dirs": []}
        if os.path.exists(self.file):
            try:
                with open(self.file) as f:
                    self.data = json.load(f)
            except (OSError, ValueError) as err:
                raise OSError(
                    f"{self.file}: install state unreadable ({err}); move it away to start over"
                ) from err

    @property
    def exists(self) -> bool:
        return os.path.exists(self.file)

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        files: dict[str, dict[str, Any]] = self.data.setdefault("files", {})
        return files

    @property
    def dirs(self) -> list[str]:
        dirs: list[str] = self.data.setdefault("dirs", [])
        return dirs

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value

    def save(self) -> None:
        if "state_dirs" not in self.data:
            # Which of /var/lib/cedana/node's parents install creates: uninstall removes
            # exactly those (when empty), never a store that lives beside them.
            created = []
            d = os.path.dirname(STATE_FILE)
            while d != "/" and not os.path.isdir(self.host.path(d)):
                created.append(d)
                d = os.path.dirname(d)
            self.data["state_dirs"] = created
        os.makedirs(os.path.dirname(self.file), mode=0o700, exist_ok=True)
        atomic_write(self.file, json.dumps(self.data, indent=2, sort_keys=True).encode(), 0o600)

    def backup_dir(self) -> str:
        return os.path.join(os.path.dirname(self.file), "backups")


class Managed:
    """Files and links the installer writes, with the prior state of each recorded
    the first time it is touched (a later install never overwrites that record)."""

    def __init__(self, host: HostRoot, state: InstallState) -> None:
        self.host = host
        self.state = state

    def ensure_dir(self, host_dir: str, mode: int = 0o755) -> None:
        """Create ``host_dir`` and its missing parents, remembering which were new."""
        missing: list[str] = []
        current = host_dir.rstrip("/")
        while current and not os.path.isdir(self.host.path(current)):
            missing.append(current)
            current = os.path.dirname(current)
        for d in reversed(missing):
            os.mkdir(self.host.path(d), mode)
            if d not in self.state.dirs:
                self.state.dirs.append(d)
        if missing:
            self.state.save()

    def _remember(self, host_path: str, now: Observed) -> None:
        if host_path in self.state.files:
            return
        prior: dict[str, Any] = {"kind": now.kind}
        if now.kind == "file":
            os.makedirs(self.state.backup_dir(), mode=0o700, exist_ok=True)
            backup = os.path.join(self.state.backup_dir(), f"{sha256(host_path.encode())[:16]}")
            atomic_write(backup, now.data, 0o600)
            prior.update(backup=backup, mode=now.mode, uid=now.uid, gid=now.gid)
            prior["sha256"] = sha256(now.data)
        elif now.kind == "symlink":
            prior["target"] = now.target
        self.state.files[host_path] = {"prior": prior}
        self.state.save()

    def put_file(self, host_path: str, data: bytes, mode: int | None = None) -> bool:
        """Make ``host_path`` hold ``data`` (``mode``: default the file's current mode,
        else 0644); True when that changed anything."""
        self.ensure_dir(os.path.dirname(host_path))
        real = self.host.path(host_path, follow_last=False)
        now = observe(real)
        if mode is None:
            mode = now.mode if now.kind == "file" else 0o644
        self._remember(host_path, now)
        record = self.state.files[host_path]
        same = now.kind == "file" and now.data == data and now.mode == mode
        if same and record.get("written", {}).get("sha256") == sha256(data):
            return False
        record["written"] = {"kind": "file", "sha256": sha256(data)}
        if same:
            self.state.save()
            return False
        if now.kind == "symlink":
            os.unlink(real)
        uid, gid = (now.uid, now.gid) if now.kind == "file" else (-1, -1)
        atomic_write(real, data, mode, uid, gid)
        self.state.save()
        return True

    def put_symlink(self, host_path: str, target: str) -> bool:
        self.ensure_dir(os.path.dirname(host_path))
        real = self.host.path(host_path, follow_last=False)
        now = observe(real)
        self._remember(host_path, now)
        record = self.state.files[host_path]
        record["written"] = {"kind": "symlink", "target": target}
        self.state.save()
        if now.kind == "symlink" and now.target == target:
            return False
        tmp = f"{real}.cedana-tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.symlink(target, tmp)
        os.replace(tmp, real)
        return True

    def unchanged_since_install(self, host_path: str) -> bool:
        record = self.state.files.get(host_path, {})
        written = record.get("written")
        if written is None:
            return True  # recorded but never written: the prior state is still there
        now = observe(self.host.path(host_path, follow_last=False))
        if written["kind"] == "symlink":
            return now.kind == "symlink" and now.target == written["target"]
        return now.kind == "file" and sha256(now.data) == written["sha256"]

    def restore(self, host_path: str) -> str:
        """Put back what was there before install; returns what was done."""
        record = self.state.files.get(host_path)
        if record is None:
            return "not installed"
        real = self.host.path(host_path, follow_last=False)
        prior = record["prior"]
        if prior["kind"] == "absent":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(real)
            outcome = "removed"
        elif prior["kind"] == "symlink":
            tmp = f"{real}.cedana-tmp"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            os.symlink(prior["target"], tmp)
            os.replace(tmp, real)
            outcome = "restored"
        else:
            with open(prior["backup"], "rb") as f:
                data = f.read()
            if os.path.islink(real):
                os.unlink(real)
            atomic_write(real, data, prior["mode"], prior["uid"], prior["gid"])
            outcome = "restored"
        self.forget(host_path)
        return outcome

    def forget(self, host_path: str, *, keep_backup: bool = False) -> None:
        record = self.state.files.pop(host_path, None)
        backup = (record or {}).get("prior", {}).get("backup")
        if backup and not keep_backup:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(backup)
        self.state.save()

    def remove_created_dirs(self) -> list[str]:
        """Remove the directories install created, deepest first, if empty."""
        left = []
        for d in sorted(self.state.dirs, key=lambda p: p.count("/"), reverse=True):
            try:
                os.rmdir(self.host.path(d, follow_last=False))
            except FileNotFoundError:
                pass
            except OSError:
                left.append(d)
        self.state.data["dirs"] = left
        return left


def copy_tree(src: str, dst: str) -> None:
    """Copy a directory tree keeping links as links and modes/mtimes (compiled
    bytecode stays valid: CPython checks the source's mtime)."""
    shutil.copytree(src, dst, symlinks=True, copy_function=shutil.copy2)

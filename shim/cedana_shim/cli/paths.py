"""Where the shim keeps its sockets; root-only, never shared with runc's shim."""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from hashlib import sha256
else:
    try:  # CPython's built-in SHA-256: hashlib loads OpenSSL, ~10 ms on the start path
        from _sha256 import sha256
    except ImportError:  # other interpreters; Python >= 3.12 calls it _sha2
        from hashlib import sha256

RUN_DIR = os.environ.get("CEDANA_RUN_DIR", "/run/cedana")
SOCKET_PATH_LIMIT = 106  # sun_path minus the NUL, as containerd enforces


def ensure_private_dir(path: str) -> str:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def shim_socket_path(containerd_address: str, namespace: str, group: str) -> str:
    """One socket per (containerd, namespace, pod group), like the runc shim's."""
    key = "\0".join((containerd_address, namespace, group, "cedana")).encode()
    return os.path.join(RUN_DIR, "s", sha256(key).hexdigest())


def code_fingerprint() -> str:
    """Identifies the interpreter and the exact package code a process runs.

    A warm fork server must only ever fork daemons of the code the caller runs,
    so its socket name carries this: after an upgrade (or an edit in a
    development checkout) a fresh server is started beside the stale one.
    """
    import sys

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files: list[str] = []
    stack = [package]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        stack.append(entry.path)
                elif entry.name.endswith(".py"):
                    st = entry.stat()
                    files.append(f"{entry.path}\0{st.st_mtime_ns}\0{st.st_size}")
    digest = sha256(os.path.realpath(sys.executable).encode())
    digest.update("\0".join(sorted(files)).encode())
    return digest.hexdigest()[:24]


def forkserver_socket_path(fingerprint: str, kind: str = "") -> str:
    """The fork server of ``kind`` ("" forks shim daemons; see forkserver.Template)."""
    name = f"{kind}-{fingerprint}" if kind else fingerprint
    return os.path.join(RUN_DIR, f"forkserver-{name}.sock")

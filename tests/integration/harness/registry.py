"""A real OCI registry for the registry client's tests: Debian's ``docker-registry``
(distribution 2.8) on 127.0.0.1, with TLS from a throwaway CA and htpasswd users.

`Registry` starts it on a free port with its storage in a directory of the test's,
stops, kills, pauses (SIGSTOP: a registry that accepts connections and never
answers) and restarts it on the same port and storage, and reaches into the
filesystem driver's layout to corrupt a stored blob or to add tags. `HungServer` is a
socket that accepts and never answers at all.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

from .util import wait_for

REGISTRY_BIN = "/usr/bin/docker-registry"
USER = "cedana"
PASSWORD = "s3cret-pw"
# A fixed secret signs upload sessions, so one survives a restart of the registry.
_HTTP_SECRET = "cedana-test-upload-state-secret"


# The registry prefix of the tests' node configs (conftest's node_env).
PREFIX = "cedana"


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path  # the CA's certificate: what a client trusts (registry_ca)
    cert_dir: Path  # holds ca.crt alone: skopeo's --cert-dir
    server_cert: Path
    server_key: Path


def make_test_ca(workdir: Path) -> TlsFiles:
    """A CA and a server certificate for 127.0.0.1 and localhost, signed by it."""
    workdir.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = workdir / "ca.key", workdir / "ca.crt"
    key, csr, cert = workdir / "server.key", workdir / "server.csr", workdir / "server.crt"
    ext = workdir / "server.ext"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "basicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
    )
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(ca_key))
    _openssl(
        "req", "-x509", "-new", "-key", str(ca_key), "-out", str(ca_cert), "-days", "2",
        "-subj", "/CN=cedana test CA", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key))
    _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
        "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext),
    )  # fmt: skip
    cert_dir = workdir / "certs.d"
    cert_dir.mkdir(exist_ok=True)
    shutil.copy(ca_cert, cert_dir / "ca.crt")
    return TlsFiles(ca_cert=ca_cert, cert_dir=cert_dir, server_cert=cert, server_key=key)


def htpasswd_line(user: str, password: str) -> str:
    """``user:$2b$...``: the bcrypt hash distribution's htpasswd auth wants."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt  # glibc's libxcrypt makes $2b$ (bcrypt) hashes

    # The lowest cost bcrypt allows: the registry checks it on every request.
    hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))
    assert hashed.startswith("$2b$"), "this libc's crypt() cannot make bcrypt hashes"
    return f"{user}:{hashed}"


def write_auth_file(path: Path, host: str, user: str, password: str, mode: int = 0o600) -> Path:
    """A docker config.json with one ``auths`` entry."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {host: {"auth": token}}}))
    path.chmod(mode)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Registry:
    """One docker-registry process; its port and storage survive restarts."""

    def __init__(
        self,
        workdir: Path,
        *,
        tls: TlsFiles | None,
        auth: bool = True,
        delete_enabled: bool = True,
    ) -> None:
        self.workdir = workdir
        self.tls = tls
        self.storage = workdir / "storage"
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.log_path = workdir / "registry.log"
        self.config_path = workdir / "config.yml"
        self._auth = auth
        self._delete_enabled = delete_enabled
        self._process: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        self.storage.mkdir(exist_ok=True)
        if auth:
            (workdir / "htpasswd").write_text(htpasswd_line(USER, PASSWORD) + "\n")
        self._write_config()

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def _write_config(self) -> None:
        lines = [
            "version: 0.1",
            "log:",
            "  level: info",
            "storage:",
            "  filesystem:",
            f"    rootdirectory: {self.storage}",
            "  delete:",
            f"    enabled: {'true' if self._delete_enabled else 'false'}",
            "  maintenance:",
            "    uploadpurging:",
            "      enabled: false",
            "http:",
            f"  addr: 127.0.0.1:{self.port}",
            f"  secret: {_HTTP_SECRET}",
        ]
        if self.tls is not None:
            lines += [
                "  tls:",
                f"    certificate: {self.tls.server_cert}",
                f"    key: {self.tls.server_key}",
            ]
        if self._auth:
            lines += [
                "auth:",
                "  htpasswd:",
                "    realm: cedana-test",
                f"    path: {self.workdir / 'htpasswd'}",
            ]
        self.config_path.write_text("\n".join(lines) + "\n")

    def start(self) -> None:
        assert self._process is None, "already running"
        log = self.log_path.open("ab")
        self._process = subprocess.Popen(
            [REGISTRY_BIN, "serve", str(self.config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        wait_for(self._answers, timeout=20, what=f"docker-registry on {self.host}")

    def _answers(self) -> bool:
        process = self._process
        if process is not None and process.poll() is not None:
            raise AssertionError(
                f"docker-registry exited with {process.returncode}:\n{self.log_tail()}"
            )
        context = ssl.create_default_context(cafile=str(self.tls.ca_cert)) if self.tls else None
        try:
            with urllib.request.urlopen(
                f"{self.scheme}://{self.host}/v2/", timeout=2, context=context
            ):
                return True
        except urllib.error.HTTPError as err:
            return err.code == 401
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the process (SIGKILL: as if the node died) and wait for it."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)
                if sig != signal.SIGKILL:
                    # A paused process acts on SIGTERM only once it runs again; SIGKILL
                    # must not let it run (it would read what waits in its sockets).
                    process.send_signal(signal.SIGCONT)
        process.wait(timeout=20)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the registry: it keeps its socket, the kernel accepts, nobody answers."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    def blob_data_path(self, digest: str) -> Path:
        """The file of a blob in the filesystem driver's layout."""
        hex_digest = digest.removeprefix("sha256:")
        return (
            self.storage / "docker/registry/v2/blobs/sha256" / hex_digest[:2] / hex_digest / "data"
        )

    def corrupt_blob(self, digest: str, offset: int = 0) -> None:
        """Flip one byte of a stored blob (its size stays the same)."""
        path = self.blob_data_path(digest)
        with path.open("r+b") as handle:
            handle.seek(offset)
            byte = handle.read(1)
            handle.seek(offset)
            handle.write(bytes([byte[0] ^ 0xFF]))

    def add_tags(self, repo: str, existing_tag: str, new_tags: list[str]) -> None:
        """Point more tags at the manifest of ``existing_tag``, straight on disk
        (thousands of tags in a second instead of thousands of PUTs)."""
        tags_dir = self.storage / "docker/registry/v2/repositories" / repo / "_manifests/tags"
        source = tags_dir / existing_tag
        for tag in new_tags:
            shutil.copytree(source, tags_dir / tag)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


class HungServer:
    """A TCP socket that accepts connections and never sends a byte."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port: int = self._listener.getsockname()[1]
        self.host = f"127.0.0.1:{self.port}"
        self._accepted: list[socket.socket] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._accepted.append(conn)

    @property
    def connections(self) -> int:
        return len(self._accepted)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)
        for conn in self._accepted:
            conn.close()


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise AssertionError(f"openssl {' '.join(args)} failed: {result.stderr.strip()}")


def skopeo(*args: str) -> subprocess.CompletedProcess[str]:
    """Run skopeo (without a signature policy: these are test images)."""
    return subprocess.run(
        ["skopeo", "--insecure-policy", *args], capture_output=True, text=True, timeout=120
    )


__all__ = [
    "PASSWORD",
    "PREFIX",
    "USER",
    "HungServer",
    "Registry",
    "TlsFiles",
    "free_port",
    "htpasswd_line",
    "make_test_ca",
    "skopeo",
    "write_auth_file",
]

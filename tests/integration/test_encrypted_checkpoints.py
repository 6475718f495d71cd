"""Checkpoints nobody else can read or forge: encrypted layers and signed checkpoints.

Containerds of their own ("nodes", as in test_across_nodes.py) share one real
registry (docker-registry, TLS, htpasswd). Node A encrypts every layer it pushes for
one recipient (encryption_keys) and signs every checkpoint (signing_key); the keys
are made with openssl, as an operator would. The workload is a counter whose shell
holds a random marker in memory only.

- after the stop, no blob in the registry holds the marker, raw or zstd-decompressed;
- `skopeo copy --decryption-key` copies the checkpoint out, and its decrypted layers
  do hold the marker; `cosign verify --key` accepts the signature;
- a node without the key starts cold, the reason naming the key it lacks; a node
  with it (and the old key beside a new one: rotation) resumes the count;
- checkpoints a forger pushed (valid encryption, unsigned or signed by another key,
  newer) are skipped with that reason on a node trusting only the real key, which
  restores the real one.
"""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import zstandard
from cedana_shim.checkpoint.remote import RemoteStore
from cedana_shim.checkpoint.remote.encryption import Encryption
from cedana_shim.checkpoint.remote.signing import Signer
from cedana_shim.checkpoint.store import Store, StoreConfig
from cedana_shim.registry import RegistryClient
from support.forged import adopt_forged, forge, zstd_bomb

from .conftest import MakeNode
from .harness.config import CTR_NAMESPACE, DEPS_DIR
from .harness.cr_events import TOPIC_EXIT, EventStream
from .harness.cr_support import (
    Box,
    Workloads,
    assert_continues,
    counter_script,
    entries,
    restored_from,
    started_cold,
    unique_label,
    wait_compacted,
    wait_ticks,
)
from .harness.registry import (
    PASSWORD,
    PREFIX,
    USER,
    Registry,
    TlsFiles,
    skopeo,
)
from .harness.remote_support import registry_config

NewId = Callable[[str], str]
pytestmark = pytest.mark.ctrd_versions("2.1")
COSIGN = DEPS_DIR / "cosign" / "usr" / "bin" / "cosign"
# The shell draws the marker itself: it is in the process's memory and nowhere else
# (its output goes to the container's log on the host, not into the checkpoint).
MARKER_SCRIPT = (
    "mk=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')\n"
    'echo "marker $mk"\n'
    'mk="$mk $mk $mk $mk"\n'
)


def _openssl(*args: str) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"openssl {' '.join(args)}: {done.stderr}"


def key_pair(directory: Path, name: str, kind: str) -> tuple[Path, Path]:
    """(private PEM, mode 0600; public PEM), made by openssl as an operator would."""
    private, public = directory / f"{name}.key", directory / f"{name}.pub"
    if kind == "rsa":
        _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
                 "-out", str(private))  # fmt: skip
    else:
        _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
                 "-out", str(private))  # fmt: skip
    private.chmod(0o600)
    _openssl("pkey", "-in", str(private), "-pubout", "-out", str(public))
    return private, public


def fingerprint(public: Path) -> str:
    der = subprocess.run(
        ["openssl", "pkey", "-pubin", "-in", str(public), "-outform", "DER"],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    return "sha256:" + hashlib.sha256(der).hexdigest()


def _stop(w: Workloads, box: Box, events: EventStream) -> str:
    wait_ticks(box.lines, count=3)
    w.ctr("task", "kill", "-s", "SIGTERM", box.cid)
    committed = events.wait_commit(box.cid, timeout=60)
    exited = events.wait_topic(TOPIC_EXIT, box.cid, timeout=120, id=box.cid)
    assert exited.field("exit_status") == 143, exited
    w.delete(box)
    return committed.checkpoint_id


def _marker(box: Box) -> str:
    for line in box.lines():
        if line.startswith("marker "):
            return line.split()[1]
    raise AssertionError(f"the workload printed no marker: {box.lines()[:5]}")


def _registry_blobs(registry: Registry) -> list[bytes]:
    blobs = sorted((registry.storage / "docker" / "registry" / "v2" / "blobs").rglob("data"))
    assert blobs, f"no blob in {registry.storage}"
    return [path.read_bytes() for path in blobs]


def _plain_views(data: bytes) -> list[bytes]:
    """A blob as stored, and zstd-decompressed when it decompresses."""
    views = [data]
    with contextlib.suppress(zstandard.ZstdError):
        views.append(zstandard.ZstdDecompressor().decompressobj().decompress(data))
    return views


def _tag(registry: Registry, checkpoint: str) -> str:
    tags = (registry.storage / "docker/registry/v2/repositories" / PREFIX / CTR_NAMESPACE
            / "_manifests" / "tags")  # fmt: skip
    (found,) = [t.name for t in tags.iterdir() if checkpoint.split("-")[-1] in t.name
                and not t.name.endswith(".pending")]  # fmt: skip
    return found


def test_an_encrypted_signed_checkpoint_moves_only_to_a_node_with_the_key(
    make_node: MakeNode,
    node_env: dict[str, str],
    registry: Registry,
    tls: TlsFiles,
    tmp_path: Path,
    new_id: NewId,
) -> None:
    assert COSIGN.is_file(), f"{COSIGN} is missing: run scripts/setup-node-deps.sh"
    old_key, old_pub = key_pair(tmp_path, "old", "rsa")
    new_key, new_pub = key_pair(tmp_path, "new", "ec")
    sign_key, sign_pub = key_pair(tmp_path, "sign", "ec")
    label = unique_label("sealed")
    script = counter_script(extra=MARKER_SCRIPT)
    a = make_node(
        {
            **node_env,
            "CEDANA_ENCRYPTION_KEYS": f"jwe:{old_pub}",
            "CEDANA_SIGNING_KEY": str(sign_key),
        }
    )
    with (
        EventStream(a.socket) as events_a,
        Workloads(a, new_id, label=label, script=script, namespace=CTR_NAMESPACE) as on_a,
    ):
        first = on_a.start("a")
        wait_ticks(first.lines, count=2)
        marker = _marker(first)
        checkpoint = _stop(on_a, first, events_a)
        before = first.ticks()
        assert before is not None
    # No blob in the registry holds the marker, as stored or decompressed.
    blobs = _registry_blobs(registry)
    leaks = [b[:40] for b in blobs if any(marker.encode() in v for v in _plain_views(b))]
    assert not leaks, f"the marker is in {len(leaks)} registry blob(s) of {len(blobs)}"
    tag = _tag(registry, checkpoint)
    ref = f"{registry.host}/{PREFIX}/{CTR_NAMESPACE}:{tag}"

    # skopeo decrypts it with the recipient's private key: the marker is there.
    out = tmp_path / "decrypted"
    copied = skopeo(
        "copy", "--src-cert-dir", str(tls.cert_dir), "--src-creds", f"{USER}:{PASSWORD}",
        "--decryption-key", str(old_key), f"docker://{ref}", f"dir:{out}",
    )  # fmt: skip
    assert copied.returncode == 0, copied.stderr
    layers = [p.read_bytes() for p in out.iterdir() if p.name not in ("manifest.json", "version")]
    assert any(marker.encode() in v for b in layers for v in _plain_views(b))
    # Without the key, skopeo cannot.
    refused = skopeo(
        "copy", "--src-cert-dir", str(tls.cert_dir), "--src-creds", f"{USER}:{PASSWORD}",
        "--decryption-key", str(new_key), f"docker://{ref}", f"dir:{tmp_path / 'no'}",
    )  # fmt: skip
    assert refused.returncode != 0

    # cosign accepts the signature with the public key alone (no transparency log).
    verified = subprocess.run(
        [str(COSIGN), "verify", "--key", str(sign_pub), "--insecure-ignore-tlog=true",
         "--registry-cacert", str(tls.ca_cert), "--registry-username", USER,
         "--registry-password", PASSWORD, ref],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stderr
    assert "verified against the specified public key" in verified.stderr, verified.stderr

    # A node without the key starts cold, naming it.
    c = make_node({**node_env, "CEDANA_DECRYPTION_KEYS": str(new_key)})
    with (
        EventStream(c.socket) as events_c,
        Workloads(c, new_id, label=label, script=script, namespace=CTR_NAMESPACE) as on_c,
    ):
        cold = on_c.start("c")
        detail = str(started_cold(events_c, cold).field("detail"))
        assert checkpoint in detail and fingerprint(old_pub) in detail, detail
        assert "decryption_keys" in detail and str(new_key) in detail, detail
        assert not entries(c.store)
    # A node with the new key beside the old (a rotation) resumes the count.
    b = make_node(
        {
            **node_env,
            "CEDANA_ENCRYPTION_KEYS": f"jwe:{new_pub}",
            "CEDANA_DECRYPTION_KEYS": f"{new_key},{old_key}",
            "CEDANA_TRUSTED_KEYS": str(sign_pub),
        }
    )
    with (
        EventStream(b.socket) as events_b,
        Workloads(b, new_id, label=label, script=script, namespace=CTR_NAMESPACE) as on_b,
    ):
        second = on_b.start("b")
        restored_from(events_b, second, checkpoint)
        assert_continues(before, wait_ticks(second.lines, count=3), "restore of an encrypted one")


def test_forged_checkpoints_are_skipped_by_a_node_trusting_only_the_real_key(
    make_node: MakeNode,
    node_env: dict[str, str],
    registry: Registry,
    tls: TlsFiles,
    tmp_path: Path,
    new_id: NewId,
) -> None:
    """The forger can push and has the recipients' public key (so its encryption is
    valid) but not the signing key: one forgery unsigned, one signed by its own key,
    both newer than the real checkpoint. A node trusting the real key skips both, with
    the reason, and restores the real one."""
    enc_key, enc_pub = key_pair(tmp_path, "enc", "ec")
    sign_key, sign_pub = key_pair(tmp_path, "sign", "ec")
    forger_key, _ = key_pair(tmp_path, "forger", "ec")
    keys = {
        "CEDANA_ENCRYPTION_KEYS": f"jwe:{enc_pub}",
        "CEDANA_DECRYPTION_KEYS": str(enc_key),
        "CEDANA_SIGNING_KEY": str(sign_key),
        "CEDANA_TRUSTED_KEYS": str(sign_pub),
    }
    a = make_node({**node_env, **keys})
    label = unique_label("forgery")
    with (
        EventStream(a.socket) as events,
        Workloads(a, new_id, label=label, script=counter_script(), namespace=CTR_NAMESPACE) as w,
    ):
        first = w.start("a0")
        real = _stop(w, first, events)
        before = first.ticks()
        assert before is not None
        newest = wait_compacted(a.store, real)
        source = Store(StoreConfig(root=str(a.store)))
        forger_store = Store(StoreConfig(root=str(tmp_path / "forger"), cache_raw=False))
        client = RegistryClient(registry_config(registry, tls, tmp_path))
        encryption = Encryption.from_config(f"jwe:{enc_pub}", "")
        forged_ids = []
        for minutes, signer in ((1, None), (2, Signer(str(forger_key)))):
            created = datetime.fromisoformat(newest.created) + timedelta(minutes=minutes)
            forged = forge(source, newest, created, bomb=zstd_bomb(1 << 20))
            adopt_forged(forger_store, source, forged)
            forger = RemoteStore(
                forger_store, client, "node-x", signer=signer, encryption=encryption
            )
            forger.push(forged.id)
            forged_ids.append(forged.id)
        box = w.start("a1")
        detail = str(restored_from(events, box, real).field("detail"))
        unsigned, wrong = forged_ids
        assert f"{unsigned} (registry" in detail and "it is not signed" in detail, detail
        assert f"{wrong} (registry" in detail and "none of the trusted keys" in detail, detail
        assert "bytes recorded" not in detail, detail  # refused before the pull
        assert str(sign_pub) in detail, detail
        assert_continues(before, wait_ticks(box.lines, count=3), "restore past forgeries")
        assert [e.id for e in entries(a.store, label=label)] == [real]

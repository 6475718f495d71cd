"""What encrypting checkpoints costs a push and a pull, side by side in one run.

    python bench/encryption.py [--runs 5] [--mem-mib 1024] [--out results.json]

One real registry on loopback (Debian's docker-registry, plain HTTP: no TLS cost in
the denominator, so the ratio is the stricter one), one store A holding a committed
(compacted) checkpoint of N MiB of page images (half random, half a repeating text:
some of it compresses), and the remote store's own push and pull (RemoteStore, as a
shim or `cedana checkpoints push/pull` runs them): each run pushes the same
checkpoint under two labels, plain and encrypted for one EC recipient, and pulls each
into an empty store with the matching private key; the order of the two is swapped
in odd runs, with `sync` before each timed step. Fresh data every run, so nothing is
deduplicated against an earlier run. Reports the median seconds and MB/s of each, and
encrypted / plain; and the CPU seconds of each step, this process's (the pusher or
puller: RUSAGE_SELF, all threads) and the registry's (/proc/PID/stat), which a machine
shared with other work changes far less than the wall times: on two vCPUs the push is
CPU-bound, and the ratio of the two sides' total CPU is what the wall ratio tends to
on a quiet machine.

The cost measured is the whole of it: the encryption of each new chunk as it streams
(CTR: no ciphertext is kept on disk; its digest and HMAC are taken from the bytes
sent and named at the upload's commit), the JWE key wrapping of every layer, and the
decryption on the pull.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from cedana_shim.checkpoint.remote import RemoteStore
from cedana_shim.checkpoint.store import Entry, Store, StoreConfig
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_CRIU
from cedana_shim.config import NodeConfig

MiB = 1 << 20


def open_store(root: Path) -> Store:
    return Store(StoreConfig(root=str(root)))


def commit_checkpoint(store: Store, files: dict[str, bytes], label: str) -> Entry:
    """A committed (compacted) checkpoint whose CRIU layer holds ``files``."""
    metadata = {"container": "bench", "pod": "bench-0", "namespace": "bench"}
    ingest = store.writer.begin(scope="bench", label=label, metadata=metadata)
    images = Path(ingest.dir("criu"))
    for name, data in files.items():
        (images / name).write_bytes(data)
    ingest.add_dir_layer("criu", str(images), MEDIA_TYPE_CRIU)
    return store.commit(ingest)


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _registry(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    config = work / "registry.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {work / 'registry'}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n  secret: bench\n"
    )
    process = subprocess.Popen(
        ["/usr/bin/docker-registry", "serve", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=open(work / "registry.log", "wb"),  # noqa: SIM115 - the process keeps it
    )
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return process, f"127.0.0.1:{port}"
        time.sleep(0.1)
    raise SystemExit("docker-registry did not start")


def _keys(work: Path) -> tuple[Path, Path]:
    private, public = work / "enc.key", work / "enc.pub"
    subprocess.run(
        ["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-out", str(private)], check=True,
    )  # fmt: skip
    private.chmod(0o600)
    subprocess.run(
        ["openssl", "pkey", "-in", str(private), "-pubout", "-out", str(public)], check=True
    )
    return private, public


def _pages(mem_mib: int) -> bytes:
    half = mem_mib * MiB // 2
    text = (b"cedana bench page " * 300)[:4096]
    return os.urandom(half) + text * (half // 4096)


def run(runs: int, mem_mib: int) -> dict[str, Any]:
    load_before = [round(x, 2) for x in os.getloadavg()]
    work = Path(tempfile.mkdtemp(prefix="cedana-bench-enc-", dir="/var/tmp"))
    registry, host = _registry(work)
    private, public = _keys(work)
    clear = NodeConfig(registry=f"{host}/bench", registry_insecure=True)
    sides = {
        "plain": (clear, clear),
        "encrypted": (
            # A pushing node holds a recipient's private key too (it restores as well):
            # the chunk keys derive from it.
            replace(clear, encryption_keys=f"jwe:{public}", decryption_keys=str(private)),
            replace(clear, decryption_keys=str(private)),
        ),
    }
    times: dict[str, dict[str, list[float]]] = {s: {"push": [], "pull": []} for s in sides}
    # (this process's CPU seconds, the registry's) per step
    cpu: dict[str, dict[str, list[tuple[float, float]]]] = {
        s: {"push": [], "pull": []} for s in sides
    }
    size = 0
    try:
        for i in range(runs):
            store = open_store(work / f"a{i}")
            files = {"pages-1.img": _pages(mem_mib), "core-1.img": b"core" * 1000}
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for side in order:
                push_config, pull_config = sides[side]
                entry = commit_checkpoint(store, files, label=f"bench-{side}-{i}")
                size = entry.size
                a = RemoteStore.from_config(store, push_config, "node-a")
                assert a is not None
                os.sync()
                mine, theirs = _own_cpu(), _cpu_of(registry.pid)
                began = time.monotonic()
                pushed = a.push(entry.id)
                times[side]["push"].append(time.monotonic() - began)
                cpu[side]["push"].append((_own_cpu() - mine, _cpu_of(registry.pid) - theirs))
                b_store = open_store(work / f"b{i}-{side}")
                b = RemoteStore.from_config(b_store, pull_config, "node-b")
                assert b is not None
                os.sync()
                mine, theirs = _own_cpu(), _cpu_of(registry.pid)
                began = time.monotonic()
                b.pull(pushed)
                times[side]["pull"].append(time.monotonic() - began)
                cpu[side]["pull"].append((_own_cpu() - mine, _cpu_of(registry.pid) - theirs))
                shutil.rmtree(work / f"b{i}-{side}")
            shutil.rmtree(work / f"a{i}")
            print(f"run {i + 1}/{runs}: " + ", ".join(
                f"{s} push {t['push'][-1]:.2f}s (CPU {sum(cpu[s]['push'][-1]):.2f}s) "
                f"pull {t['pull'][-1]:.2f}s (CPU {sum(cpu[s]['pull'][-1]):.2f}s)"
                for s, t in times.items()
            ), flush=True)  # fmt: skip
    finally:
        registry.terminate()
        registry.wait()
        shutil.rmtree(work, ignore_errors=True)
    report: dict[str, Any] = {
        "mem_mib": mem_mib,
        "stored_bytes": size,
        "runs": runs,
        "loadavg_before": load_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    for step in ("push", "pull"):
        plain = statistics.median(times["plain"][step])
        encrypted = statistics.median(times["encrypted"][step])
        report[step] = {
            "plain_s": round(plain, 3),
            "encrypted_s": round(encrypted, 3),
            "plain_MBps": round(size / plain / 1e6, 1),
            "encrypted_MBps": round(size / encrypted / 1e6, 1),
            "encrypted_over_plain": round(encrypted / plain, 3),
            # The spread: each side's fastest and slowest run.
            "range_s": {s: [round(f(times[s][step]), 3) for f in (min, max)] for s in times},
            "all_s": {s: [round(x, 3) for x in times[s][step]] for s in times},
        }
        # Median CPU seconds: [this process, the registry], and encrypted / plain of
        # their sum.
        medians = {s: [statistics.median(c[k] for c in cpu[s][step]) for k in (0, 1)] for s in cpu}
        report[step]["cpu_s"] = {s: [round(x, 3) for x in m] for s, m in medians.items()}
        report[step]["cpu_encrypted_over_plain"] = round(
            sum(medians["encrypted"]) / sum(medians["plain"]), 3
        )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mem-mib", type=int, default=1024)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = run(args.runs, args.mem_mib)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""The checkpoint store's criu layer: one tar+zstd blob versus page images as chunks.

Makes a CRIU-like image dir (a ``pages-1.img`` of mixed random, low-entropy and
zero data, ``--size-mib`` MiB, plus small files) and, ``--runs`` times,
interleaved, compacts it into a fresh store with ``chunk_size=0`` (one blob, the
format before chunks) and with ``--chunk-mib`` chunks, timing ``compact`` and
``extract_layer`` (chunked: with 2 decompressing workers, the default, and
with 1). Then, in one chunked store, compacts the dir and a copy with 10 % of
``pages-1.img`` rewritten in one contiguous region, and reports how many new
chunk bytes the second compaction wrote. Last, whether zstd gives the same bytes
for the same chunk single-threaded, multi-threaded and streaming.

No containerd here: the store's own API, on the root disk (``CEDANA_BENCH_TMPDIR``,
default /var/tmp). The image files are hard-linked into each checkpoint, so
every compaction reads them from the page cache (both formats alike); blobs are
fsynced as the store always does.

    python bench/store_chunks.py [--runs 5] [--size-mib 1024] [--chunk-mib 32] [--out f.json]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    Report,
    ensure_venv,
    load_average,
    print_table,
    summarize,
    wall,
    work_root,
)

ensure_venv()

import zstandard  # noqa: E402
from cedana_shim.checkpoint.store import Entry, Store, StoreConfig, reader  # noqa: E402
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_CRIU  # noqa: E402

MIB = 1 << 20
SMALL_FILES = {
    "inventory.img": 64,
    "core-1.img": 4096,
    "mm-1.img": 64 << 10,
    "pagemap-1.img": 256 << 10,
    "pstree.img": 64,
    "files.img": 8192,
}


def mixed(size: int) -> bytes:
    """Like process memory: 40 % random, 40 % low-entropy (16 symbols), 20 % zeros per MiB."""
    out = io.BytesIO()
    symbols = bytes(b"ABCDEFGHIJKLMNOP"[i % 16] for i in range(256))
    while out.tell() < size:
        out.write(os.urandom(410 * 1024))
        out.write(os.urandom(410 * 1024).translate(symbols))
        out.write(bytes(MIB - 820 * 1024))
    return out.getvalue()[:size]


def make_images(path: Path, size: int) -> None:
    path.mkdir(parents=True)
    (path / "pages-1.img").write_bytes(mixed(size))
    for name, n in SMALL_FILES.items():
        (path / name).write_bytes(os.urandom(n))


def rewrite_region(src: Path, dest: Path, fraction: float) -> tuple[int, int]:
    """A copy of ``src`` with one contiguous ``fraction`` of pages-1.img rewritten."""
    shutil.copytree(src, dest)
    pages = dest / "pages-1.img"
    size = pages.stat().st_size
    length = int(size * fraction)
    start = size * 3 // 10 + 12345  # not on a chunk boundary
    with open(pages, "r+b") as f:
        f.seek(start)
        f.write(mixed(length))
    return start, length


def commit(store: Store, images: Path) -> tuple[Entry, float]:
    """Publish ``images`` (hard-linked) raw, then time its compaction."""
    ing = store.writer.begin(scope="bench", label="chunks", metadata={"container": "bench"})
    criu = Path(ing.dir("criu"))
    for name in sorted(os.listdir(images)):
        os.link(images / name, criu / name)
    ing.add_dir_layer("criu", str(criu), MEDIA_TYPE_CRIU)
    raw = store.writer.publish(ing)
    compacted: list[Entry | None] = []
    seconds = wall(lambda: compacted.append(store.compactor.compact(raw.id)))
    entry = compacted[0]
    assert entry is not None and entry.state == "compacted"
    return entry, seconds


def extract(store: Store, entry: Entry, dest: Path, workers: int) -> float:
    saved = reader._EXTRACT_WORKERS
    reader._EXTRACT_WORKERS = workers  # type: ignore[misc]
    try:
        return wall(lambda: store.reader.extract_layer(entry, "criu", str(dest)))
    finally:
        reader._EXTRACT_WORKERS = saved  # type: ignore[misc]
        shutil.rmtree(dest, ignore_errors=True)


def same_file(a: Path, b: Path) -> bool:
    def digest(p: Path) -> str:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while block := f.read(8 * MIB):
                h.update(block)
        return h.hexdigest()

    return a.stat().st_size == b.stat().st_size and digest(a) == digest(b)


def formats(args: argparse.Namespace, work: Path, images: Path) -> dict[str, Any]:
    chunk = args.chunk_mib * MIB
    samples: dict[str, list[float]] = {
        k: [] for k in ("compact one blob", "compact chunks", "extract one blob",
                        "extract chunks, 2 workers", "extract chunks, 1 worker")
    }  # fmt: skip
    stored: dict[str, int] = {}
    for run in range(args.runs):
        order = [("one blob", 0), ("chunks", chunk)]
        # Alternating which goes first: neither always inherits the other's dirty pages.
        for name, chunk_size in order if run % 2 == 0 else order[::-1]:
            root = work / f"store-{run}-{chunk_size}"
            store = Store(StoreConfig(root=str(root), chunk_size=chunk_size, cache_raw=False))
            entry, seconds = commit(store, images)
            samples[f"compact {name}"].append(seconds)
            stored[name] = entry.layers[0].size
            dest = work / "out"
            if run == 0:  # once: the extracted page image is the original, byte for byte
                store.reader.extract_layer(entry, "criu", str(dest))
                assert same_file(dest / "pages-1.img", images / "pages-1.img")
                shutil.rmtree(dest)
            if chunk_size:
                for workers in (2, 1) if run % 2 == 0 else (1, 2):
                    label = f"extract chunks, {workers} worker{'s' if workers > 1 else ''}"
                    samples[label].append(extract(store, entry, dest, workers))
            else:
                samples["extract one blob"].append(extract(store, entry, dest, 1))
            shutil.rmtree(root)
        print(f"run {run + 1}/{args.runs} done; load average {load_average()}", flush=True)
    summaries = {k: summarize(v) for k, v in samples.items()}
    print_table(
        ("step", "median s", "min s", "max s", "stdev s"),
        [
            (k, f"{s.median:.2f}", f"{s.min:.2f}", f"{s.max:.2f}", f"{s.stdev:.2f}")
            for k, s in summaries.items()
        ],
    )
    print(f"stored bytes: {stored}")
    return {
        "samples_s": samples,
        "summary": {k: s.as_dict() for k, s in summaries.items()},
        "stored_bytes": stored,
    }


def rewrite(args: argparse.Namespace, work: Path, images: Path) -> dict[str, Any]:
    changed = work / "images-changed"
    start, length = rewrite_region(images, changed, args.rewrite)
    root = work / "store-rewrite"
    store = Store(StoreConfig(root=str(root), chunk_size=args.chunk_mib * MIB, cache_raw=False))
    blobs = root / "blobs" / "sha256"
    first, first_s = commit(store, images)
    before = set(os.listdir(blobs))
    second, second_s = commit(store, changed)
    added = set(os.listdir(blobs)) - before
    first_chunks = sum(c.size for c in first.layers[0].chunks)
    new_chunks = {
        c.digest: c.size
        for c in second.layers[0].chunks
        if c.digest.removeprefix("sha256:") in added
    }
    new_chunk_bytes = sum(new_chunks.values())
    new_bytes = sum((blobs / name).stat().st_size for name in added)
    shutil.rmtree(root)
    shutil.rmtree(changed)
    result = {
        "rewritten": {"offset": start, "length": length, "fraction": args.rewrite},
        "first": {"chunks": len(first.layers[0].chunks), "chunk_bytes": first_chunks,
                  "stored_bytes": first.size, "compact_s": round(first_s, 3)},
        "second": {"new_chunks": len(new_chunks), "new_chunk_bytes": new_chunk_bytes,
                   "new_blob_bytes": new_bytes, "compact_s": round(second_s, 3)},
        "new_chunk_fraction": round(new_chunk_bytes / first_chunks, 4),
        "new_blob_fraction": round(new_bytes / first.size, 4),
    }  # fmt: skip
    print(
        f"second compaction ({args.rewrite:.0%} of pages-1.img rewritten at {start}): "
        f"{len(new_chunks)} new chunks, {new_chunk_bytes} bytes = "
        f"{result['new_chunk_fraction']:.1%} of the first's {first_chunks} chunk bytes; "
        f"all new blobs {new_bytes} bytes = {result['new_blob_fraction']:.1%} of its {first.size}; "
        f"compaction {second_s:.2f} s (first {first_s:.2f} s)"
    )
    return result


def determinism(chunk: int) -> dict[str, str]:
    """sha256 of one chunk compressed each way (level 3): which ways agree."""
    data = mixed(chunk)
    ways: dict[str, bytes] = {}
    for threads in (0, 1, 2):
        ways[f"one shot, threads={threads}"] = zstandard.ZstdCompressor(
            level=3, threads=threads, write_checksum=True
        ).compress(data)
    stream = zstandard.ZstdCompressor(level=3, write_checksum=True).compressobj(size=len(data))
    ways["streamed, threads=0"] = (
        b"".join(stream.compress(data[i : i + (128 << 10)]) for i in range(0, len(data), 128 << 10))
        + stream.flush()
    )
    result = {k: hashlib.sha256(v).hexdigest()[:16] for k, v in ways.items()}
    for k, v in result.items():
        print(f"zstd {k}: {v}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--chunk-mib", type=int, default=32)
    parser.add_argument("--rewrite", type=float, default=0.10)
    parser.add_argument("--out", default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    report = Report("store_chunks", vars(args))
    work = work_root()
    try:
        images = work / "images"
        make_images(images, args.size_mib * MIB)
        report.results["formats"] = formats(args, work, images)
        report.results["rewrite"] = rewrite(args, work, images)
        report.results["zstd_determinism"] = determinism(args.chunk_mib * MIB)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

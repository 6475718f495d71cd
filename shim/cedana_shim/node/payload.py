"""The self-contained Python environment the shim runs from on a node.

A payload is a Python prefix that needs nothing outside itself but the C library:
the interpreter (``bin/python3.X``, ``lib/libpython*`` for a shared build), its
standard library, and in its own ``site-packages`` cedana-shim and every
distribution it requires. It finds its standard library relative to the
interpreter, so it works wherever it is put: ``/opt/cedana`` on the host, and a
temporary host root in tests. The launchers in ``bin/`` are shell scripts that
locate the interpreter next to themselves (``readlink -f``), so the links in
``/usr/local/bin`` work from any root.

``build`` assembles a payload from the running interpreter: in the DaemonSet's
image that interpreter is the payload's own (``/opt/cedana/bin/python3``), and by
hand on a node it is whatever venv ``cedana`` was installed into.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from cedana_shim import __version__
from cedana_shim.launcher import DEFAULT_MODULE, FAST_DELETE

from . import registration as reg

MANIFEST: Final = "cedana-bundle.json"
# Its closure without extras: the node agent's `node` extra (the Kubernetes client and
# what only it needs, ~150 MB) serves the DaemonSet helper, which runs in its image,
# never from the host's environment.
ROOT_DISTRIBUTION: Final = "cedana-shim"
# Parts of the standard library a node never runs (tests, GUI, build files).
STDLIB_SKIP: Final = frozenset(
    {"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip",
     "lib2to3", "pydoc_data"}
)  # fmt: skip
LAUNCHERS: Final = {
    reg.SHIM_BINARY: "cedana_shim.cli.shim_main",
    "cedana": "cedana_shim.cli.admin",
}
_NAME_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


class PayloadError(Exception):
    pass


@dataclass(frozen=True)
class Manifest:
    version: str  # cedana-shim
    python: str  # "3.11.7"
    digest: str  # over every path, mode, link target and file content
    portable: bool  # False: the interpreter needs something outside the payload
    notes: tuple[str, ...] = ()
    source: str = ""  # source_id() of the environment it was built from

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "python": self.python,
            "digest": self.digest,
            "portable": self.portable,
            "notes": list(self.notes),
            "source": self.source,
        }

    @classmethod
    def load(cls, root: str) -> Manifest | None:
        try:
            with open(os.path.join(root, MANIFEST)) as f:
                raw = json.load(f)
            return cls(
                version=str(raw["version"]),
                python=str(raw["python"]),
                digest=str(raw["digest"]),
                portable=bool(raw.get("portable", True)),
                notes=tuple(raw.get("notes", ())),
                source=str(raw.get("source", "")),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None


def launcher_script(module: str, pyver: str) -> str:
    # -I: containerd's environment (PYTHONPATH, PYTHONHOME...) and the bundle directory
    # it runs the shim in must not change which code runs. -S and a fixed path instead
    # of site and runpy, and one fork (readlink) rather than two: containerd runs the
    # shim's start and delete on every container's critical path. The shim's `delete`
    # after a clean delete is answered by the shell alone (cedana_shim.launcher).
    shim = module == DEFAULT_MODULE
    entry = (
        f"from {module} import launch; launch()"
        if shim
        else (f"from {module} import main; sys.exit(main())")
    )
    return (
        "#!/bin/sh\n"
        "# cedana-shim launcher (written by `cedana node bundle`): runs the payload's own\n"
        "# interpreter, wherever the payload is.\n"
        + (FAST_DELETE if shim else "")
        + 'here=$(readlink -f "$0") && here=${here%/*}\n'
        f'exec "$here/python{pyver}" -IS -c "import sys; '
        f'sys.path[:0] = [sys.argv.pop(1)]; {entry}" '
        f'"$here/../lib/python{pyver}/site-packages" "$@"\n'
    )


def tree_digest(root: str) -> str:
    """One hash over the whole tree (the manifest itself excluded)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(
            filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        ):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if rel == MANIFEST:
                continue
            st = os.lstat(path)
            h.update(f"{rel}\0{st.st_mode & 0o7777:o}\0".encode())
            if os.path.islink(path):
                h.update(b"L" + os.readlink(path).encode())
            else:
                with open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
            h.update(b"\0")
    return h.hexdigest()


def source_id() -> str:
    """Names the environment a payload would be built from (interpreter, every bundled
    distribution's version, cedana_shim's files), so that a node whose payload came
    from this very environment is recognised without building and hashing a new one:
    the helper re-runs install every few minutes."""
    h = hashlib.sha256(os.path.realpath(sys.executable).encode())
    h.update(sys.version.encode())
    for dist in sorted(_closure(ROOT_DISTRIBUTION), key=lambda d: d.metadata["Name"] or ""):
        h.update(f"{dist.metadata['Name']}=={dist.version}\0".encode())
    spec = importlib.util.find_spec("cedana_shim")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                st = os.stat(os.path.join(dirpath, name))
                h.update(f"{dirpath}/{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def _requirement_names(dist: metadata.Distribution) -> Iterable[str]:
    for req in dist.requires or ():
        name, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        m = _NAME_RE.match(name)
        if m:
            yield m.group(1)


def _closure(root: str) -> list[metadata.Distribution]:
    """``root`` and everything it requires that is installed here (a requirement that
    is not installed was for another platform: the running shim works without it)."""
    seen: dict[str, metadata.Distribution] = {}
    pending = [root]
    while pending:
        name = pending.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if name == root:
                raise PayloadError(f"{root} is not installed in {sys.prefix}") from None
            continue
        seen[key] = dist
        pending.extend(_requirement_names(dist))
    return list(seen.values())


def _copy_file(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.islink(src):
        os.symlink(os.readlink(src), dst)
    else:
        shutil.copy2(src, dst)


def _copy_distribution(dist: metadata.Distribution, site: str) -> None:
    base = str(dist.locate_file(""))
    for entry in dist.files or ():
        rel = str(entry)
        if rel.startswith("..") or os.path.isabs(rel):
            continue  # console scripts: the payload has its own launchers
        if rel.startswith("__editable__") or (rel.endswith(".pth") and "editable" in rel):
            continue
        src = os.path.join(base, rel)
        dst = os.path.join(site, rel)
        if os.path.lexists(src) and not os.path.lexists(dst):
            _copy_file(src, dst)


def _copy_package_source(package: str, site: str) -> None:
    """An editable install keeps the package outside site-packages: copy its tree."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PayloadError(f"cannot find the {package} package to bundle")
    src = next(iter(spec.submodule_search_locations))
    dst = os.path.join(site, package)
    if not os.path.exists(dst):
        shutil.copytree(src, dst, symlinks=True, copy_function=shutil.copy2)


def _loaded_libpython() -> str | None:
    """The libpython this process runs on (a shared build), as the loader found it:
    sysconfig's LIBDIR is where the build put it, which need not exist here."""
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[-1].strip()
            if "/libpython" in path and os.path.exists(path):
                return path
    return None


def _copy_stdlib(stdlib: str, dest: str) -> None:
    def ignore(directory: str, names: list[str]) -> set[str]:
        if os.path.abspath(directory) == os.path.abspath(stdlib):
            return {n for n in names if n in STDLIB_SKIP or n.startswith("config-")}
        return set()

    shutil.copytree(stdlib, dest, symlinks=True, ignore=ignore, copy_function=shutil.copy2)


def build(output: str) -> Manifest:
    """Assemble a payload at ``output`` (which must not exist) from this interpreter."""
    if os.path.lexists(output):
        raise PayloadError(f"{output} already exists: pick a new directory")
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    interpreter = os.path.realpath(sys.executable)
    stdlib = sysconfig.get_paths()["stdlib"]
    bindir = os.path.join(output, "bin")
    libdir = os.path.join(output, "lib")
    site = os.path.join(libdir, f"python{pyver}", "site-packages")
    try:
        os.makedirs(bindir)
        shutil.copy2(interpreter, os.path.join(bindir, f"python{pyver}"))
        os.symlink(f"python{pyver}", os.path.join(bindir, "python3"))
        libpython = _loaded_libpython()
        if libpython is not None:
            os.makedirs(libdir, exist_ok=True)
            shutil.copy2(libpython, os.path.join(libdir, os.path.basename(libpython)))
        _copy_stdlib(stdlib, os.path.join(libdir, f"python{pyver}"))
        os.makedirs(site, exist_ok=True)
        for dist in _closure(ROOT_DISTRIBUTION):
            _copy_distribution(dist, site)
        _copy_package_source("cedana_shim", site)
        for name, module in LAUNCHERS.items():
            path = os.path.join(bindir, name)
            with open(path, "w") as f:
                f.write(launcher_script(module, pyver))
            os.chmod(path, 0o755)
        prefix = check_runs(output)
        if os.path.realpath(prefix) != os.path.realpath(output):
            raise PayloadError(
                f"the bundled interpreter took its standard library from {prefix}, not from "
                f"{output}: this Python ({interpreter}) cannot be relocated; build the "
                "payload from a relocatable CPython, or use the node image "
                "(packaging/image/build.py)"
            )
        notes = portability_notes(output, pyver)
        manifest = Manifest(
            version=__version__,
            python=".".join(map(str, sys.version_info[:3])),
            digest=tree_digest(output),
            portable=not notes,
            notes=tuple(notes),
            source=source_id(),
        )
        with open(os.path.join(output, MANIFEST), "w") as f:
            json.dump(manifest.to_json(), f, indent=2)
        return manifest
    except BaseException:
        shutil.rmtree(output, ignore_errors=True)
        raise


def check_runs(root: str) -> str:
    """Run the payload's interpreter on its own code; returns its ``sys.prefix``."""
    pyver = _payload_pyver(root)
    argv = [
        os.path.join(root, "bin", f"python{pyver}"),
        "-I",
        "-c",
        "import sys, cedana_shim.cli.shim_main, google.protobuf, zstandard; print(sys.prefix)",
    ]
    proc = subprocess.run(argv, capture_output=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise PayloadError(
            f"{argv[0]} cannot run cedana-shim (exit {proc.returncode}): "
            f"{proc.stderr.decode(errors='replace').strip()[-2000:]}"
        )
    return proc.stdout.decode().strip()


def _payload_pyver(root: str) -> str:
    for name in sorted(os.listdir(os.path.join(root, "bin"))):
        m = re.fullmatch(r"python(\d+\.\d+)", name)
        if m:
            return m.group(1)
    raise PayloadError(f"{root}/bin has no python3.X interpreter: not a cedana payload")


def portability_notes(root: str, pyver: str) -> list[str]:
    """What the interpreter loads from outside the payload besides the C library
    (e.g. a libpython found through an absolute RUNPATH)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        proc = subprocess.run(
            ["ldd", os.path.join(root, "bin", f"python{pyver}")],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        notes = []
        for line in proc.stdout.splitlines():
            m = re.match(r"\s*(libpython\S*) => (\S+)", line)
            if m and not os.path.realpath(m.group(2)).startswith(os.path.realpath(root) + "/"):
                notes.append(
                    f"the interpreter loads {m.group(1)} from {m.group(2)} (an absolute "
                    "RUNPATH): the payload only works where that file exists"
                )
        return notes
    return []

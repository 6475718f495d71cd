"""The node image's steps that run inside a Debian root, under that root's python3.11.

``prefix``: in the build root (Debian's python3.11, patchelf, the image's wheels
installed in ``/usr/lib/python3.11/site-packages``), turn Debian's interpreter into a
relocatable one and assemble ``/opt/cedana`` from it with ``cedana node bundle``:

- every shared library the interpreter, the standard library's extension modules and
  the wheels' extension modules load, other than the C library's own, is copied into
  ``lib/python3.11/lib-deps`` (inside the standard library, so ``cedana node bundle``
  copies it along on every node install) and found there through a RUNPATH relative
  to ``$ORIGIN``: the payload needs nothing on a node but glibc;
- ``sitecustomize.py`` (beside this file) makes Debian's site.py see the prefix's
  ``site-packages``;
- the payload is built, then the distributions only the DaemonSet helper needs (the
  Kubernetes client, which the payload leaves out) are added to the image's copy.

``check``: in the image root, build a payload from the image's own interpreter (what
the helper does on every node) and run it in a root holding nothing but libc6's files.

Why Debian's interpreter: a python-build-standalone CPython (relocatable, glibc >=
2.17) only comes from GitHub, which CI and the developers' machines cannot reach, and
PyPI ships no relocatable CPython. Debian's python3.11 links libpython statically and
finds its standard library relative to itself, so it relocates once its shared
libraries travel with it. The cost: the payload needs the glibc of Debian 12 (2.36,
the newest symbol version among the interpreter, 2.35, and the libraries bundled with
it; build.py's summary reports it as ``needs_glibc``), and the installer refuses hosts
with an older one (its check that the payload runs on the host).

Errors exit with status 1 and one line that says what failed.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys

PYVER = f"{sys.version_info.major}.{sys.version_info.minor}"
STDLIB = f"/usr/lib/python{PYVER}"
LIB_DEPS = f"{STDLIB}/lib-deps"
# The wheels go where a payload keeps them, so RUNPATHs relative to $ORIGIN hold in both.
WHEELS_SITE = f"{STDLIB}/site-packages"
PREFIX = "/opt/cedana"
_libc = ctypes.CDLL(None, use_errno=True)
HERE = os.path.dirname(os.path.abspath(__file__))
# What a payload must import on a node with only glibc: the shim, the installer's CRI
# client, and the standard library modules that load shared libraries of their own.
IMPORT_CHECK = (
    "import ssl, hashlib, ctypes, lzma, bz2, zlib, decimal, uuid, sqlite3, "
    "xml.parsers.expat, grpc, zstandard, cedana_shim.cli.shim_main, cedana_shim.cli.admin; "
    "from google.protobuf.internal import api_implementation as a; "
    "assert a.Type() == 'upb', a.Type(); "
    "hashlib.new('sha256'); ssl.create_default_context(); "
    "import sys; print(sys.prefix)"
)


class AssembleError(Exception):
    pass


def _run(argv: list[str], **kwargs: object) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise AssembleError(
            f"`{' '.join(argv)}` exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()}"
        )
    return str(proc.stdout)


def _libc_sonames() -> set[str]:
    """The C library's own sonames (libc, libm, the loader...): found on every node."""
    names = {
        os.path.basename(path)
        for path in _run(["dpkg-query", "-L", "libc6"]).splitlines()
        if re.search(r"\.so(\.\d+)*$", path)
    }
    if "libc.so.6" not in names:
        raise AssembleError("dpkg-query -L libc6 does not list libc.so.6: not a Debian root?")
    return names


def _is_elf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def _loaded_libraries(path: str) -> dict[str, str]:
    """soname -> the file the loader picks, for everything ``path`` loads."""
    found: dict[str, str] = {}
    for line in _run(["ldd", path]).splitlines():
        m = re.match(r"\s*(\S+) => (.+?) \(0x", line)
        if m is None:
            continue
        if m.group(2) == "not found":
            raise AssembleError(f"{path} needs {m.group(1)}, which is not installed here")
        found[m.group(1)] = os.path.realpath(m.group(2))
    return found


def _extension_modules() -> list[str]:
    paths = [os.path.realpath(f"/usr/bin/python{PYVER}")]
    for base in (f"{STDLIB}/lib-dynload", WHEELS_SITE):
        for dirpath, _dirs, files in os.walk(base):
            paths += [
                os.path.join(dirpath, f)
                for f in sorted(files)
                if ".so" in f and not os.path.islink(os.path.join(dirpath, f))
            ]
    return [p for p in paths if _is_elf(p)]


def _foreign(path: str, libc: set[str]) -> dict[str, str]:
    """What ``path`` loads from outside the C library and outside its own wheel."""
    return {
        soname: target
        for soname, target in _loaded_libraries(path).items()
        if soname not in libc and not target.startswith((LIB_DEPS + "/", WHEELS_SITE + "/"))
    }


def _patchelf(path: str, *args: str) -> None:
    """On a copy renamed over the original: the interpreter running this is one of them."""
    staged = f"{path}.patchelf"
    shutil.copy2(path, staged)
    _run(["patchelf", *args, staged])
    os.replace(staged, path)


def bundle_shared_libraries() -> None:
    libc = _libc_sonames()
    os.makedirs(LIB_DEPS, exist_ok=True)
    for path in _extension_modules():
        needed = _foreign(path, libc)
        if not needed:
            continue
        for soname, target in needed.items():
            copy = os.path.join(LIB_DEPS, soname)
            if not os.path.exists(copy):
                shutil.copy2(os.path.realpath(target), copy)
                _patchelf(copy, "--set-rpath", "$ORIGIN")
        rel = os.path.relpath(LIB_DEPS, os.path.dirname(path))
        _patchelf(path, "--add-rpath", f"$ORIGIN/{rel}")
    for path in _extension_modules() + [os.path.join(LIB_DEPS, n) for n in os.listdir(LIB_DEPS)]:
        left = _foreign(path, libc)
        if left:
            raise AssembleError(f"{path} still loads {sorted(left.values())} from the build root")


def assemble_prefix() -> None:
    bundle_shared_libraries()
    sitecustomize = f"{STDLIB}/sitecustomize.py"
    if os.path.lexists(sitecustomize):
        os.unlink(sitecustomize)  # Debian's: a link to /etc, which a node does not have
    shutil.copy2(os.path.join(HERE, "sitecustomize.py"), sitecustomize)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    print(_run([f"/usr/bin/python{PYVER}", "-m", "cedana_shim.node", "bundle", PREFIX, "--json"],
               env=env), end="")  # fmt: skip
    # The image's prefix also serves `cedana node run` (the Kubernetes client): it is an
    # environment to build payloads from, not a payload, so it has no manifest.
    site = f"{PREFIX}/lib/python{PYVER}/site-packages"
    _run(["cp", "-a", "--no-clobber", f"{WHEELS_SITE}/.", site])
    shutil.rmtree(os.path.join(site, "bin"), ignore_errors=True)
    os.unlink(f"{PREFIX}/cedana-bundle.json")


def _libc_only_root(root: str) -> None:
    """A root with libc6's files and the usr-merge links, and nothing else."""
    for name in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink(f"/{name}"):
            os.symlink(os.readlink(f"/{name}"), os.path.join(root, name))
    for path in _run(["dpkg-query", "-L", "libc6"]).splitlines():
        parent = os.path.realpath(os.path.dirname(path))
        here = os.path.join(parent, os.path.basename(path))
        if os.path.lexists(root + here) or (os.path.isdir(here) and not os.path.islink(here)):
            continue
        os.makedirs(root + parent, exist_ok=True)
        if os.path.islink(here):  # e.g. /usr/lib64/ld-linux-x86-64.so.2, the ELF interpreter
            os.symlink(os.readlink(here), root + here)
        elif os.path.isfile(here):
            shutil.copy2(here, root + here)


# The image has no mount(8) (Debian's `mount` is not Essential): the system calls.
_MS_BIND = 4096


def _bind_mount(source: str, target: str) -> None:
    if _libc.mount(source.encode(), target.encode(), None, _MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bind-mounting {source} on {target}: {os.strerror(err)}")


def _unmount(target: str) -> None:
    if _libc.umount2(target.encode(), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unmounting {target}: {os.strerror(err)}")


def check_image() -> None:
    payload = "/tmp/payload-check"
    shutil.rmtree(payload, ignore_errors=True)
    manifest = json.loads(_run([f"{PREFIX}/bin/cedana", "node", "bundle", payload, "--json"]))
    if not manifest.get("portable"):
        raise AssembleError(f"the payload is not portable: {manifest}")
    root = "/tmp/libc-only"
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    proc = os.path.join(root, "proc")
    try:
        _libc_only_root(root)
        shutil.copytree(payload, root + PREFIX, symlinks=True)
        # The loader finds $ORIGIN through /proc/self/exe, as on any node.
        os.makedirs(proc)
        _bind_mount("/proc", proc)

        def enter() -> None:
            os.chroot(root)
            os.chdir("/")

        prefix = _run(
            [f"{PREFIX}/bin/python{PYVER}", "-I", "-c", IMPORT_CHECK], preexec_fn=enter, env={}
        ).strip()
        if prefix != PREFIX:
            raise AssembleError(f"the payload's interpreter took {prefix} as its prefix")
    finally:
        if os.path.ismount(proc):
            _unmount(proc)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(payload, ignore_errors=True)
    print(json.dumps({"payload": manifest, "runs_on_libc_only": True}))


def main() -> int:
    steps = {"prefix": assemble_prefix, "check": check_image}
    if len(sys.argv) != 2 or sys.argv[1] not in steps:
        print(f"usage: {sys.argv[0]} {{{'|'.join(steps)}}}", file=sys.stderr)
        return 2
    try:
        steps[sys.argv[1]]()
    except (AssembleError, OSError) as err:
        print(f"assemble {sys.argv[1]}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The launcher containerd execs as ``containerd-shim-cedana-v2``.

``start`` and ``delete`` run once per container on containerd's critical path,
and a Python process's start-up is most of their cost. pip's console-script
wrapper imports ``re`` and lets ``site`` scan every ``.pth`` file; a shell
launcher forks ``readlink`` and ``dirname``. This launcher starts the
interpreter with ``-sS`` (no site, no user site) and a fixed ``sys.path``. The Slurm
job runner (``cedana-slurm-task``, on every protected job's launch path) gets one
too (``--module cedana_shim.cli.slurm_task``).

    python -m cedana_shim.launcher DEST [--python PY] [--path DIR]... [--module M]
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig

TEMPLATE = """#!{python} -sS
# Written by `python -m cedana_shim.launcher`: a hot path (the shim, the Slurm job runner).
import sys
sys.path[:0] = {paths!r}
from {module} import main
sys.exit(main())
"""
DEFAULT_MODULE = "cedana_shim.cli.shim_main"


def default_paths() -> list[str]:
    """Where this interpreter finds cedana_shim and its dependencies."""
    import cedana_shim

    paths = [os.path.dirname(os.path.dirname(os.path.abspath(cedana_shim.__file__)))]
    for key in ("purelib", "platlib"):
        path = sysconfig.get_paths()[key]
        if path not in paths:
            paths.append(path)
    return paths


def launcher_text(python: str, paths: list[str], module: str = DEFAULT_MODULE) -> str:
    if " " in python or not os.path.isabs(python):
        raise ValueError(f"the launcher's interpreter must be an absolute path: {python!r}")
    if not all(part.isidentifier() for part in module.split(".")):
        raise ValueError(f"not a module name: {module!r}")
    return TEMPLATE.format(python=python, paths=paths, module=module)


def write_launcher(
    dest: str,
    python: str | None = None,
    paths: list[str] | None = None,
    module: str = DEFAULT_MODULE,
) -> None:
    text = launcher_text(python or sys.executable, paths or default_paths(), module)
    tmp = f"{dest}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cedana_shim.launcher", description=__doc__)
    parser.add_argument("dest", help="where to write the launcher")
    parser.add_argument("--python", help="interpreter (default: this one)")
    parser.add_argument("--path", action="append", help="sys.path entry (default: this one's)")
    parser.add_argument(
        "--module", default=DEFAULT_MODULE, help="whose main() to run (default %(default)s)"
    )
    args = parser.parse_args(argv)
    write_launcher(args.dest, args.python, args.path, args.module)
    return 0


if __name__ == "__main__":
    sys.exit(main())

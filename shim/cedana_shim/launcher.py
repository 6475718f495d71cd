"""The launchers containerd execs as ``containerd-shim-cedana-v2`` and Slurm as the job runner.

``start`` and ``delete`` run once per container on containerd's critical path,
and a Python process's start-up is most of their cost. pip's console-script
wrapper imports ``re`` and lets ``site`` scan every ``.pth`` file; a shell
launcher that finds its directory forks ``readlink`` and ``dirname``. These
launchers start the interpreter with ``-IS``: isolated (containerd's
``PYTHONPATH``, ``PYTHONDONTWRITEBYTECODE``... change nothing, as for the fork
server), no site, and a fixed ``sys.path``.

The shim's launcher is a ``/bin/sh`` script: containerd runs ``delete`` after every
container, and when the daemon has already deleted it (the normal case) the bundle
holds the whole answer (:func:`cedana_shim.bundle_state.mark_deleted`), which the
shell prints without starting Python at all (~1 ms instead of ~10). Everything else
goes to Python. The Slurm job runner (``--module cedana_shim.cli.slurm_task``) is
a Python script.

    python -m cedana_shim.launcher DEST [--python PY] [--path DIR]... [--module M]
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig

PYTHON_TEMPLATE = """#!{python} -IS
# Written by `python -m cedana_shim.launcher`: a hot path (the Slurm job runner).
import sys
sys.path[:0] = {paths!r}
from {module} import main
sys.exit(main())
"""
SHIM_TEMPLATE = """#!/bin/sh
# Written by `python -m cedana_shim.launcher`: containerd's shim binary, a hot path.
{fast_delete}exec {python} -IS -c {code} "$0" "$@"
"""
# Python's argv is then [-c, launcher, args...]: argv[0] becomes the launcher's path, as
# if Python ran it as a script (proctitle shows it).
SHIM_CODE = (
    "import sys; del sys.argv[0]; sys.path[:0] = {paths}; from {module} import launch; launch()"
)
DEFAULT_MODULE = "cedana_shim.cli.shim_main"
# What containerd runs after every container: `... -id ID -bundle B delete` (in B). The
# flags are scanned as cli/args.py parses them, conservatively: a flag this does not
# know, `-v`, `-info`, `--` or a value it cannot place leaves everything to Python. The
# mark is printed only when it is exactly what bundle_state.mark_deleted writes, one
# or more \ooo escapes of bytes (\000-\377) and nothing else, so printf sees no
# conversion; anything else goes to Python, which reads the same marks.
FAST_DELETE = r"""bundle= want= action=
for arg do
	if [ -n "$want" ]; then
		[ "$want" = bundle ] && bundle=$arg
		want=
		continue
	fi
	case $arg in
	-bundle | --bundle) want=bundle ;;
	-bundle=* | --bundle=*) bundle=${arg#*=} ;;
	-namespace | --namespace | -address | --address | -publish-binary | --publish-binary | \
	-id | --id | -socket | --socket | -debug-socket | --debug-socket) want=value ;;
	-namespace=* | --namespace=* | -address=* | --address=* | -publish-binary=* | \
	--publish-binary=* | -id=* | --id=* | -socket=* | --socket=* | -debug-socket=* | \
	--debug-socket=* | -debug | --debug) ;;
	-*) break ;;
	*) action=$arg; break ;;
	esac
done
if [ "$action" = delete ] && [ -z "$want" ]; then
	mark=${bundle:-.}/cedana-deleted
	if [ -f "$mark" ] && IFS= read -r response <"$mark"; then
		case $response in
		'' | [!\\]* | *[!0-7\\]* | *\\ | *\\[!0-3]* | *\\[0-7] | *\\[0-7][0-7] | \
		*\\[0-7]\\* | *\\[0-7][0-7]\\* | *[0-7][0-7][0-7][0-7]*) ;;
		*) printf "$response"; exit ;;
		esac
	fi
fi
"""


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
    import json
    import shlex

    if " " in python or not os.path.isabs(python):
        raise ValueError(f"the launcher's interpreter must be an absolute path: {python!r}")
    if not all(part.isidentifier() for part in module.split(".")):
        raise ValueError(f"not a module name: {module!r}")
    if module != DEFAULT_MODULE:
        return PYTHON_TEMPLATE.format(python=python, paths=paths, module=module)
    # JSON's list of strings is a Python literal, in double quotes: no shell escapes.
    code = SHIM_CODE.format(paths=json.dumps(paths), module=module)
    return SHIM_TEMPLATE.format(
        fast_delete=FAST_DELETE, python=shlex.quote(python), code=shlex.quote(code)
    )


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

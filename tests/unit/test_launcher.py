"""The fast launchers: the shim's /bin/sh script (delete answered from the bundle's
mark without Python, everything else to `python -IS`) and the Slurm runner's script."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from cedana_shim.bundle_state import mark_deleted
from cedana_shim.launcher import launcher_text, write_launcher
from cedana_shim.wire import delete_response
from hypothesis import given, settings
from hypothesis import strategies as st
from support.examples import examples

# Shells the launcher must behave the same under: what /bin/sh is here (dash on
# Debian) and bash, which is /bin/sh elsewhere.
SHELLS = ("/bin/sh", "/bin/bash")
# A stand-in interpreter: shows how the launcher called Python.
FAKE_PYTHON = '#!/bin/sh\nprintf PYTHON; for a do printf " [%s]" "$a"; done\n'
MARK_IDS = ["before-the-fast-path", "a-conversion", "no-newline", "empty", "not-octal",
            "a-lone-backslash", "two-backslashes", "one-digit", "two-digits", "four-digits",
            "over-255", "leading-space"]  # fmt: skip
SHIM_FLAGS = ["-namespace", "k8s.io", "-address", "/run/containerd/containerd.sock",
              "-publish-binary", "/usr/bin/containerd", "-id", "c1"]  # fmt: skip


def test_the_launchers_run_the_named_modules() -> None:
    shim = launcher_text("/usr/bin/python3", ["/opt/c"])
    assert shim.startswith("#!/bin/sh\n")
    assert "exec /usr/bin/python3 -IS -c " in shim
    assert "from cedana_shim.cli.shim_main import launch; launch()" in shim
    assert 'sys.path[:0] = ["/opt/c"]' in shim
    runner = launcher_text("/usr/bin/python3", ["/opt/c"], "cedana_shim.cli.slurm_task")
    assert runner.startswith("#!/usr/bin/python3 -IS\n")
    assert "from cedana_shim.cli.slurm_task import main" in runner
    assert "sys.path[:0] = ['/opt/c']" in runner
    with pytest.raises(ValueError, match="not a module name"):
        launcher_text("/usr/bin/python3", [], "os; import evil")


@pytest.fixture
def shim(tmp_path: Path) -> Path:
    python = tmp_path / "python3"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    launcher = tmp_path / "containerd-shim-cedana-v2"
    write_launcher(str(launcher), str(python), ["/opt/c"])
    return launcher


def run(shell: str, launcher: Path, args: list[str], cwd: Path) -> bytes:
    proc = subprocess.run(
        [shell, str(launcher), *args], cwd=cwd, capture_output=True, check=True, timeout=10
    )
    assert proc.stderr == b""
    return proc.stdout


def python_called_with(launcher: Path, args: list[str]) -> bytes:
    code = 'import sys; del sys.argv[0]; sys.path[:0] = ["/opt/c"]; '
    code += "from cedana_shim.cli.shim_main import launch; launch()"
    called = ["-IS", "-c", code, str(launcher), *args]
    return ("PYTHON" + "".join(f" [{a}]" for a in called)).encode()


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize(
    "how",
    [
        ["-bundle", "{b}", "delete"],  # what containerd runs
        ["-bundle={b}", "delete"],
        ["--bundle", "{b}", "-debug", "delete"],
        ["delete"],  # the bundle is the working directory
        ["-bundle", "", "delete"],  # an empty -bundle is the working directory too
    ],
)
def test_delete_after_the_daemon_deleted_is_answered_by_the_shell(
    shell: str, how: list[str], shim: Path, tmp_path: Path
) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    mark_deleted(str(bundle), 4242, 137, 1700000000.25)
    args = SHIM_FLAGS + [a.format(b=bundle) for a in how]
    assert run(shell, shim, args, cwd=bundle) == delete_response(4242, 137, 1700000000.25)


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize(
    "args",
    [
        ["-bundle", "{b}", "start"],
        ["-id", "delete"],  # a flag's value, not the action: the daemon
        ["-bundle", "delete"],  # likewise
        ["-v", "-bundle", "{b}", "delete"],  # -v wins over the action
        ["-info"],
        ["-bundle", "{b}", "--", "delete"],  # left to Python's reading of `--`
        ["-bundle", "{b}", "-unknown", "delete"],  # an error for Python to report
        ["-bundle", "{b}", "-debug=true", "delete"],
        ["-bundle", "{b}/nothing-here", "delete"],  # no mark: the full cleanup
        [],
    ],
)
def test_everything_else_goes_to_python_untouched(
    shell: str, args: list[str], shim: Path, tmp_path: Path
) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    mark_deleted(str(bundle), 1, 0, 1.0)
    argv = SHIM_FLAGS + [a.format(b=bundle) for a in args]
    assert run(shell, shim, argv, cwd=tmp_path) == python_called_with(shim, argv)


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize(
    "mark",
    [
        "4242 137 1700000000.25\n",
        "\\101%s\\102\n",
        "\\101\\102",
        "",
        "\\1019\n",
        "\\101\\\n",
        "\\101\\\\102\n",
        "\\1\\102\n",
        "\\10\n",
        "\\1011\n",
        "\\477\n",
        " \\101\n",
    ],
    ids=MARK_IDS,
)
def test_a_mark_the_shell_cannot_vouch_for_goes_to_python(
    shell: str, mark: str, shim: Path, tmp_path: Path
) -> None:
    (tmp_path / "cedana-deleted").write_text(mark)
    argv = [*SHIM_FLAGS, "delete"]
    assert run(shell, shim, argv, cwd=tmp_path) == python_called_with(shim, argv)


@settings(max_examples=examples(30), deadline=None)
@given(
    pid=st.integers(0, 2**31 - 1),
    status=st.integers(0, 255),
    when=st.floats(0, 2**32, allow_nan=False),
)
def test_the_shell_prints_exactly_the_response_bytes(pid: int, status: int, when: float) -> None:
    """Every byte value, NUL included (an exit time of 0 has an empty Timestamp)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        python = root / "python3"
        python.write_text(FAKE_PYTHON)
        python.chmod(0o755)
        launcher = root / "shim"
        write_launcher(str(launcher), str(python), ["/opt/c"])
        mark_deleted(tmp, pid, status, when)
        out = subprocess.run(
            [str(launcher), *SHIM_FLAGS, "delete"], cwd=tmp, capture_output=True, check=True
        ).stdout
        assert out == delete_response(pid, status, when)


def test_the_launcher_is_executable_and_runs_the_real_shim(tmp_path: Path) -> None:
    launcher = tmp_path / "containerd-shim-cedana-v2"
    write_launcher(str(launcher))
    assert os.access(launcher, os.X_OK)
    out = subprocess.run([str(launcher), "-v"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("containerd-shim-cedana-v2:\n  Version: ")
    bad = subprocess.run([str(launcher), "-nope"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "flag provided but not defined: -nope" in bad.stderr

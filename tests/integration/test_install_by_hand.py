"""README's "Registering the runtime on a node by hand", step 1, run as written in a
fresh venv (a real `pip install .` of a copy of this checkout, dependencies from the
package index): the shim it puts on containerd's PATH is the fast launcher for that
venv, not pip's console-script wrapper, and it runs the installed shim.

Only the two paths are moved under a temporary directory: the venv
(`/opt/cedana-shim`) and containerd's PATH directory (`/usr/local/bin`)."""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTION = "## Registering the runtime on a node by hand"
VENV = "/opt/cedana-shim"
BIN_DIR = "/usr/local/bin"
SHIM = "containerd-shim-cedana-v2"


def by_hand_commands() -> str:
    readme = (REPO / "README.md").read_text()
    assert SECTION in readme, f"README.md has no section {SECTION!r}"
    section = re.split(r"\n##+ ", readme.split(SECTION, 1)[1])[0]
    blocks = re.findall(r"\n( *)```sh\n(.*?)\n\1```", section, re.S)
    assert blocks, f"README.md's {SECTION!r} has no ```sh block of commands"
    _indent, body = blocks[0]
    return textwrap.dedent(body)


def test_the_readme_by_hand_install_ends_with_the_fast_launcher(tmp_path: Path) -> None:
    commands = by_hand_commands()
    assert VENV in commands and f"{BIN_DIR}/{SHIM}" in commands, commands
    venv, bin_dir = tmp_path / "venv", tmp_path / "bin"
    bin_dir.mkdir()
    checkout = tmp_path / "checkout"
    # A copy: pip builds in the source tree (build/, *.egg-info) of the shared checkout.
    for name in ("pyproject.toml", "README.md"):
        checkout.mkdir(exist_ok=True)
        shutil.copy2(REPO / name, checkout / name)
    shutil.copytree(
        REPO / "shim", checkout / "shim", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    script = commands.replace(VENV, str(venv)).replace(BIN_DIR, str(bin_dir))
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{script}\n-> {proc.returncode}\n{proc.stdout}{proc.stderr}"

    shim = bin_dir / SHIM
    text = shim.read_text()
    python = venv / "bin" / "python"
    expected = subprocess.run(
        [python, "-c", "import sys; from cedana_shim.launcher import launcher_text, "
         "default_paths; sys.stdout.write(launcher_text(sys.executable, default_paths()))"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert text == expected, text
    assert str(venv / "lib") in text  # the venv's own site-packages, not this checkout
    wrapper = (venv / "bin" / SHIM).read_text()
    assert "import re" in wrapper and text != wrapper  # pip's console script is left alone
    version = subprocess.run([shim, "-v"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith(f"{SHIM}:\n  Version: "), version.stdout

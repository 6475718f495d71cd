"""The CRIU socket probe: what it says when CRIU cannot dump a TCP socket."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from cedana_shim.node.criu_probe import probe_inet_dump

FAKE_CRIU = """#!{python}
# Writes a dump log as CRIU 4.1 does on Linux >= 6.16 and fails; records its argv.
import os, sys
argv = sys.argv[1:]
open({record!r}, "w").write(" ".join(argv))
images = argv[argv.index("-D") + 1]
with open(os.path.join(images, argv[argv.index("-o") + 1]), "w") as f:
    f.write("(00.01) Error (criu/sockets.c:523): sockets: Can't get 1:16 opt: "
            "Operation not supported\\n")
    f.write("(00.02) Error (criu/cr-dump.c:1975): Dumping FAILED.\\n")
sys.exit({code})
"""


def _fake(tmp_path: Path, code: int) -> tuple[str, Path]:
    record = tmp_path / "argv"
    criu = tmp_path / "criu"
    criu.write_text(FAKE_CRIU.format(python=sys.executable, record=str(record), code=code))
    criu.chmod(0o755)
    return str(criu), record


def test_a_criu_that_cannot_read_inet_sockets_is_named_with_the_fix(tmp_path: Path) -> None:
    criu, record = _fake(tmp_path, 1)
    problem = probe_inet_dump(criu)
    assert problem is not None
    assert criu in problem and os.uname().release in problem
    assert "sockets: Can't get 1:16 opt" in problem
    assert "install CRIU >= 4.2" in problem
    argv = record.read_text().split()
    assert argv[:2] == ["dump", "-t"] and "--leave-running" in argv
    # The process it was asked to dump was the probe's listener, gone afterwards.
    assert not Path(f"/proc/{argv[2]}").exists()
    assert not Path(argv[argv.index("-D") + 1]).exists()  # its temp dir too


def test_a_criu_that_dumps_passes(tmp_path: Path) -> None:
    criu, _ = _fake(tmp_path, 0)
    assert probe_inet_dump(criu) is None


def test_a_criu_that_does_not_run_is_reported(tmp_path: Path) -> None:
    problem = probe_inet_dump(str(tmp_path / "missing-criu"))
    assert problem is not None and "cannot run" in problem

"""The fast launcher (no site, fixed sys.path) for the shim and the Slurm runner."""

from __future__ import annotations

import pytest
from cedana_shim.launcher import launcher_text


def test_the_launcher_runs_the_named_modules_main() -> None:
    shim = launcher_text("/usr/bin/python3", ["/opt/c"])
    assert shim.startswith("#!/usr/bin/python3 -sS\n")
    assert "from cedana_shim.cli.shim_main import main" in shim
    runner = launcher_text("/usr/bin/python3", ["/opt/c"], "cedana_shim.cli.slurm_task")
    assert "from cedana_shim.cli.slurm_task import main" in runner
    assert "sys.path[:0] = ['/opt/c']" in runner
    with pytest.raises(ValueError, match="not a module name"):
        launcher_text("/usr/bin/python3", [], "os; import evil")

"""cedana-slurm-task: the Slurm job runner's composition root (what the SPANK plugin
execs for an opted-in batch step); the runner itself lives in cedana_shim.slurm."""

from __future__ import annotations

import sys

from ..slurm.runner import main as run
from .wiring import NodePipelines


def main() -> int:
    return run(sys.argv[1:], NodePipelines)

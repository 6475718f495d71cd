"""Pick the GPU checkpoint backend for this node: the driver API, else cuda-checkpoint.

The driver API comes first: no process per step, and errors arrive as CUresult
codes instead of text. cuda-checkpoint covers nodes whose driver API cannot be
reached from the shim.
"""

from __future__ import annotations

from typing import Literal

from .driver import CudaCheckpointDriver, GpuError, GpuUnavailable
from .driver_api import DriverApi
from .driver_cli import CliDriver, Runner, subprocess_runner

Backend = Literal["auto", "driver-api", "cuda-checkpoint"]

INSTALL_HINT = (
    "install NVIDIA driver >= 570 and the shim's GPU extra (pip install 'cedana-shim[gpu]', "
    "which brings cuda-bindings), or put cuda-checkpoint "
    "(https://github.com/NVIDIA/cuda-checkpoint) on the shim's PATH"
)


def choose_driver(
    container_id: str = "",
    *,
    prefer: Backend = "auto",
    run: Runner | None = None,
    cli_path: str | None = None,
) -> CudaCheckpointDriver:
    """The first usable backend, or :class:`GpuUnavailable` naming the container and
    why each backend cannot be used. ``run`` is how cuda-checkpoint gets started
    (the daemon passes :func:`.driver_cli.reaper_runner`)."""
    reasons: list[str] = []
    if prefer in ("auto", "driver-api"):
        try:
            return DriverApi()
        except GpuError as err:
            reasons.append(f"driver API: {err.detail}")
    if prefer in ("auto", "cuda-checkpoint"):
        try:
            cli = CliDriver(cli_path, run=run or subprocess_runner)
            cli.probe()
            return cli
        except GpuError as err:
            reasons.append(f"cuda-checkpoint: {err.detail}")
    who = f"container {container_id}" if container_id else "this container"
    if prefer == "auto":
        what = (
            "neither the CUDA driver checkpoint API (driver >= 570, cuda-bindings) nor "
            "cuda-checkpoint on PATH is available"
        )
    else:
        what = f"the {prefer} GPU checkpoint backend it was configured with is not available"
    text = f"{who} needs GPU checkpoint/restore but {what}: {INSTALL_HINT} ({'; '.join(reasons)})"
    raise GpuUnavailable(text, message=text)

"""GPU layer: moves the GPU state of a container's CUDA processes into host memory
before CRIU dumps them, and back after a restore.

Modules, from the bottom: :mod:`.driver` (the Protocol, states, errors),
:mod:`.driver_api` and :mod:`.driver_cli` (the two backends), :mod:`.select`,
:mod:`.inventory` (NVML), :mod:`.compat` (restore checks), :mod:`.orchestrator`
(freeze/thaw) and :mod:`.records` (what they return), :mod:`.doctor`. The fake
driver the tests use is tests/unit/fakes/fake_gpu_driver.py. Nothing here imports an
NVIDIA module at import time.
"""

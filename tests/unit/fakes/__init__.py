"""Test doubles for the edges of the unit tests (executables the shim runs, the CUDA
driver, the GPU steps)."""

"""Backend: the CUDA driver's own checkpoint API (``cuCheckpointProcess*``, driver >= 570).

Reached through cuda-bindings (``cuda.bindings.driver``; ``cuda.cuda`` in older
cuda-python releases) when it is installed, otherwise straight through
``libcuda.so.1`` with ctypes: the API is five C functions over small fixed-size
structs, and every node with a GPU has libcuda while not every image has
cuda-bindings. Nothing is imported or loaded before :class:`DriverApi` is built.

Calls release the GIL in both bindings, so the orchestrator's threads run them
in parallel.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final, Protocol

from .driver import (
    Availability,
    GpuDeadlineExceeded,
    GpuError,
    GpuFailedPrecondition,
    GpuInternal,
    GpuInvalidArgument,
    GpuNotFound,
    GpuProcessExited,
    GpuUnavailable,
    GpuUnimplemented,
    ProcessState,
    Step,
    check_lock_timeout,
)

# cuDriverGetVersion reports the CUDA version the driver supports: driver 570 is
# CUDA 12.8, the first with cuCheckpointProcess*.
MIN_CUDA_VERSION: Final = 12080

CUDA_SUCCESS: Final = 0
CUDA_ERROR_INVALID_VALUE: Final = 1
CUDA_ERROR_NOT_INITIALIZED: Final = 3
CUDA_ERROR_DEINITIALIZED: Final = 4
CUDA_ERROR_NO_DEVICE: Final = 100
CUDA_ERROR_ILLEGAL_STATE: Final = 401
CUDA_ERROR_NOT_READY: Final = 600
CUDA_ERROR_NOT_SUPPORTED: Final = 801
CUDA_ERROR_TIMEOUT: Final = 909

# CUprocessState values; CHECKPOINTING/RESTORING (4, 5) exist only mid custom-storage
# operations, which the shim never starts: to us they mean "someone else is at work".
_STATES: Final[Mapping[int, ProcessState]] = {
    0: ProcessState.RUNNING,
    1: ProcessState.LOCKED,
    2: ProcessState.CHECKPOINTED,
    3: ProcessState.FAILED,
}

GpuPairs = Sequence[tuple[bytes, bytes]]  # (old UUID, new UUID), 16 raw bytes each


class Binding(Protocol):
    """The few driver entry points DriverApi needs, returning raw CUresult codes."""

    source: str

    def driver_version(self) -> tuple[int, int]: ...
    def init(self) -> int: ...
    def get_state(self, pid: int) -> tuple[int, int]: ...
    def lock(self, pid: int, timeout_ms: int) -> int: ...
    def checkpoint(self, pid: int) -> int: ...
    def restore(self, pid: int, pairs: GpuPairs) -> int: ...
    def unlock(self, pid: int) -> int: ...
    def error_name(self, code: int) -> str: ...


class CudaBindings:
    """cuda-bindings: every call returns a tuple whose first item is the CUresult."""

    def __init__(self, module: Any) -> None:
        self._cu = module
        try:
            version = importlib.metadata.version("cuda-bindings")
        except importlib.metadata.PackageNotFoundError:
            version = "?"
        self.source = f"{module.__name__} (cuda-bindings {version})"

    def driver_version(self) -> tuple[int, int]:
        err, version = self._cu.cuDriverGetVersion()
        return int(err), int(version)

    def init(self) -> int:
        return int(self._cu.cuInit(0)[0])

    def get_state(self, pid: int) -> tuple[int, int]:
        err, state = self._cu.cuCheckpointProcessGetState(pid)
        return int(err), int(state)

    def lock(self, pid: int, timeout_ms: int) -> int:
        args = self._cu.CUcheckpointLockArgs()
        args.timeoutMs = timeout_ms
        return int(self._cu.cuCheckpointProcessLock(pid, args)[0])

    def checkpoint(self, pid: int) -> int:
        return int(self._cu.cuCheckpointProcessCheckpoint(pid, None)[0])

    def restore(self, pid: int, pairs: GpuPairs) -> int:
        args = None
        if pairs:
            structs = []
            for old, new in pairs:
                # CUuuid.bytes is read-only; the pair is two 16-byte UUIDs back to back.
                pair = self._cu.CUcheckpointGpuPair()
                ctypes.memmove(pair.getPtr(), old + new, 32)
                structs.append(pair)
            args = self._cu.CUcheckpointRestoreArgs()
            args.gpuPairs = structs
            args.gpuPairsCount = len(structs)
        return int(self._cu.cuCheckpointProcessRestore(pid, args)[0])

    def unlock(self, pid: int) -> int:
        return int(self._cu.cuCheckpointProcessUnlock(pid, None)[0])

    def error_name(self, code: int) -> str:
        try:
            err, name = self._cu.cuGetErrorName(self._cu.CUresult(code))
        except Exception:
            return f"CUresult {code}"
        return name.decode() if int(err) == CUDA_SUCCESS and name else f"CUresult {code}"


class _LockArgs(ctypes.Structure):
    _fields_ = (
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    )


class _RestoreArgs(ctypes.Structure):
    # 64 bytes in every cuda.h since 12.8; later fields (custom storage) stay zero.
    _fields_ = (
        ("gpuPairs", ctypes.c_void_p),
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_char * 52),
    )


class LibcudaBinding:
    """libcuda.so.1 through ctypes, for nodes without cuda-bindings."""

    source = "libcuda.so.1 (ctypes)"

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        # Resolving every symbol now turns a pre-570 driver into one clear error.
        self._get_state = lib.cuCheckpointProcessGetState
        self._lock = lib.cuCheckpointProcessLock
        self._checkpoint = lib.cuCheckpointProcessCheckpoint
        self._restore = lib.cuCheckpointProcessRestore
        self._unlock = lib.cuCheckpointProcessUnlock
        for fn in (self._get_state, self._lock, self._checkpoint, self._restore, self._unlock):
            fn.restype = ctypes.c_int
            fn.argtypes = (ctypes.c_int, ctypes.c_void_p)

    def driver_version(self) -> tuple[int, int]:
        version = ctypes.c_int(0)
        return int(self._lib.cuDriverGetVersion(ctypes.byref(version))), version.value

    def init(self) -> int:
        return int(self._lib.cuInit(ctypes.c_uint(0)))

    def get_state(self, pid: int) -> tuple[int, int]:
        state = ctypes.c_int(-1)
        err = self._get_state(pid, ctypes.addressof(state))
        return int(err), state.value

    def lock(self, pid: int, timeout_ms: int) -> int:
        args = _LockArgs(timeoutMs=timeout_ms)
        return int(self._lock(pid, ctypes.addressof(args)))

    def checkpoint(self, pid: int) -> int:
        return int(self._checkpoint(pid, None))

    def restore(self, pid: int, pairs: GpuPairs) -> int:
        if not pairs:
            return int(self._restore(pid, None))
        raw = (ctypes.c_ubyte * (32 * len(pairs))).from_buffer_copy(
            b"".join(old + new for old, new in pairs)
        )
        args = _RestoreArgs(gpuPairs=ctypes.addressof(raw), gpuPairsCount=len(pairs))
        return int(self._restore(pid, ctypes.addressof(args)))

    def unlock(self, pid: int) -> int:
        return int(self._unlock(pid, None))

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        fn = self._lib.cuGetErrorName
        fn.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        if fn(code, ctypes.byref(name)) == CUDA_SUCCESS and name.value:
            return name.value.decode()
        return f"CUresult {code}"


def load_binding() -> Binding:
    """cuda-bindings if importable, else libcuda through ctypes; GpuUnavailable if neither."""
    for module in ("cuda.bindings.driver", "cuda.cuda"):
        try:
            return CudaBindings(importlib.import_module(module))
        except ImportError:
            continue
    try:
        return LibcudaBinding(ctypes.CDLL("libcuda.so.1"))
    except OSError as err:
        raise GpuUnavailable(
            f"no NVIDIA driver: cannot load libcuda.so.1 ({err}) and cuda-bindings is not installed"
        ) from err
    except AttributeError as err:
        raise GpuUnavailable(
            f"libcuda.so.1 has no checkpoint API ({err}): NVIDIA driver >= 570 needed"
        ) from err


def cuda_version_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


class DriverApi:
    name: ClassVar[str] = "driver-api"

    def __init__(self, binding: Binding | None = None) -> None:
        self._b = binding if binding is not None else load_binding()
        try:
            err, version = self._b.driver_version()
        except (RuntimeError, OSError, AttributeError) as exc:
            # cuda-bindings raises when it cannot find or open libcuda.
            raise GpuUnavailable(f"no NVIDIA driver: {exc}") from exc
        if err != CUDA_SUCCESS:
            raise GpuUnavailable(f"cuDriverGetVersion failed: {self._b.error_name(err)}")
        if version < MIN_CUDA_VERSION:
            raise GpuUnavailable(
                f"the driver supports CUDA {cuda_version_text(version)}; the checkpoint API "
                "needs NVIDIA driver >= 570 (CUDA 12.8)"
            )
        self.cuda_version = version
        self.source = self._b.source
        self._init_lock = threading.Lock()
        self._init_error: int | None = None

    @classmethod
    def available(cls) -> Availability:
        try:
            api = cls()
        except GpuError as err:
            return Availability(False, err.detail)
        return Availability(
            True, f"CUDA {cuda_version_text(api.cuda_version)} driver API via {api.source}"
        )

    def _ensure_init(self) -> None:
        # Restore needs cuInit in the calling process unless persistence mode is on;
        # it costs nothing after the first call and creates no context.
        with self._init_lock:
            if self._init_error is None:
                self._init_error = self._call(self._b.init)

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (RuntimeError, OSError, AttributeError) as exc:
            raise GpuUnavailable(f"CUDA driver call failed: {exc}") from exc

    def state(self, pid: int) -> ProcessState:
        self._ensure_init()
        err, value = self._call(self._b.get_state, pid)
        if err != CUDA_SUCCESS:
            raise self._error(err, pid, Step.STATE)
        state = _STATES.get(value)
        if state is None:
            # Another party is mid custom-storage checkpoint/restore of this process.
            raise GpuFailedPrecondition(
                f"the driver reports state {value}: another tool is checkpointing this process",
                pid=pid,
                step=Step.STATE,
            )
        return state

    def lock(self, pid: int, timeout_ms: int) -> None:
        check_lock_timeout(pid, timeout_ms)
        self._ensure_init()
        err = self._call(self._b.lock, pid, timeout_ms)
        if err != CUDA_SUCCESS:
            raise self._error(err, pid, Step.LOCK, timeout_ms=timeout_ms)

    def checkpoint(self, pid: int) -> None:
        self._ensure_init()
        err = self._call(self._b.checkpoint, pid)
        if err != CUDA_SUCCESS:
            raise self._error(err, pid, Step.CHECKPOINT)

    def restore(self, pid: int, device_map: Mapping[str, str] | None = None) -> None:
        pairs = uuid_pairs(device_map or {}, pid)
        self._ensure_init()
        err = self._call(self._b.restore, pid, pairs)
        if err != CUDA_SUCCESS:
            raise self._error(err, pid, Step.RESTORE, device_map=bool(pairs))

    def unlock(self, pid: int) -> None:
        self._ensure_init()
        err = self._call(self._b.unlock, pid)
        if err != CUDA_SUCCESS:
            raise self._error(err, pid, Step.UNLOCK)

    def _error(
        self, err: int, pid: int, step: Step, *, timeout_ms: int = 0, device_map: bool = False
    ) -> GpuError:
        name = self._b.error_name(err)
        if not os.path.exists(f"/proc/{pid}"):
            return GpuProcessExited(f"the process has exited ({name})", pid=pid, step=step)
        if err == CUDA_ERROR_ILLEGAL_STATE:
            return GpuFailedPrecondition(
                f"wrong state for {step} ({name}){self._state_note(pid, step)}", pid=pid, step=step
            )
        if step is Step.LOCK and err in (CUDA_ERROR_NOT_READY, CUDA_ERROR_TIMEOUT):
            return GpuDeadlineExceeded(
                f"submitted CUDA work did not finish within {timeout_ms} ms ({name}); the "
                "process keeps running: retry later or raise the lock timeout",
                pid=pid,
                step=step,
            )
        if err == CUDA_ERROR_INVALID_VALUE and device_map:
            return GpuInvalidArgument(
                f"the driver rejected the device map ({name}): every checkpointed GPU must "
                "map to a present GPU of the same model with enough free memory",
                pid=pid,
                step=step,
            )
        unusable = (CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_DEINITIALIZED, CUDA_ERROR_NO_DEVICE)
        if step is Step.STATE and err not in unusable:
            # Which code a process without CUDA gets is not documented; any refusal to
            # report a state means there is nothing of ours to freeze or thaw in it.
            return GpuNotFound(f"not a CUDA process ({name})", pid=pid, step=step)
        if err == CUDA_ERROR_NOT_SUPPORTED:
            return GpuUnimplemented(
                f"the driver cannot checkpoint this process ({name}): UVM or CUDA IPC memory, "
                "MIG and MPS are not supported",
                pid=pid,
                step=step,
            )
        if err in unusable:
            init = f"; cuInit: {self._b.error_name(self._init_error)}" if self._init_error else ""
            return GpuUnavailable(
                f"the CUDA driver is not usable from the shim ({name}{init}): enable "
                "persistence mode (nvidia-smi -pm 1) or check the shim sees /dev/nvidia*",
                pid=pid,
                step=step,
            )
        return GpuInternal(f"{name} (CUresult {err})", pid=pid, step=step)

    def _state_note(self, pid: int, step: Step) -> str:
        if step is Step.STATE:
            return ""
        try:
            return f": the process is {self.state(pid)}"
        except GpuError:
            return ""


def uuid_pairs(device_map: Mapping[str, str], pid: int | None = None) -> list[tuple[bytes, bytes]]:
    """NVML-style UUIDs (``GPU-xxxxxxxx-xxxx-...``) as the driver's raw 16-byte pairs."""
    pairs = []
    for old, new in device_map.items():
        pairs.append((uuid_bytes(old, pid), uuid_bytes(new, pid)))
    return pairs


def uuid_bytes(text: str, pid: int | None = None) -> bytes:
    body = text[4:] if text.startswith("GPU-") else text
    try:
        return uuid.UUID(body).bytes
    except ValueError as err:
        raise GpuInvalidArgument(
            f"device map entry {text!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-"
            "xxxxxxxxxxxx); MIG devices cannot be checkpointed",
            pid=pid,
            step=Step.RESTORE,
        ) from err

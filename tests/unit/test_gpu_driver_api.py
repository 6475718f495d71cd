"""The driver-API backend: CUresult codes become typed errors naming pid and step, and
both bindings (cuda-bindings, libcuda via ctypes) pass the driver the right bytes.

No GPU here: the bindings are driven through fakes that speak their conventions
(cuda-bindings' result tuples and structs with getPtr(); libcuda's C ABI, read back
from raw memory so the struct layouts are checked too)."""

from __future__ import annotations

import ctypes
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from cedana_shim.gpu import driver_api
from cedana_shim.gpu.driver import (
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
)
from cedana_shim.gpu.driver_api import (
    CudaBindings,
    DriverApi,
    LibcudaBinding,
    uuid_bytes,
)

ALIVE = os.getpid()  # errors on a live pid are classified by their code
GONE = 2**22 + 12345  # above the default pid_max: no such process
OLD = "GPU-4bd1d1e2-8f3c-4e0a-a0b9-7f1f63a3e0c1"
NEW = "GPU-9a9c3a47-2a5e-4b8e-8d7e-2f4c9d3b1a55"


@dataclass
class FakeBinding:
    """A Binding whose results the test sets; records every call."""

    version: int = 12080
    state_value: int = 0
    codes: dict[str, int] = field(default_factory=dict)
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    source: str = "fake"
    raise_on: str = ""

    def _code(self, name: str, *args: Any) -> int:
        self.calls.append((name, *args))
        if self.raise_on == name:
            raise RuntimeError("Function not found")
        return self.codes.get(name, 0)

    def driver_version(self) -> tuple[int, int]:
        return self._code("version"), self.version

    def init(self) -> int:
        return self._code("init")

    def get_state(self, pid: int) -> tuple[int, int]:
        return self._code("get_state", pid), self.state_value

    def lock(self, pid: int, timeout_ms: int) -> int:
        return self._code("lock", pid, timeout_ms)

    def checkpoint(self, pid: int) -> int:
        return self._code("checkpoint", pid)

    def restore(self, pid: int, pairs: list[tuple[bytes, bytes]]) -> int:
        return self._code("restore", pid, list(pairs))

    def unlock(self, pid: int) -> int:
        return self._code("unlock", pid)

    def error_name(self, code: int) -> str:
        return f"CUDA_ERROR_{code}"


def test_the_full_cycle_calls_the_driver_in_order() -> None:
    b = FakeBinding()
    api = DriverApi(b)
    api.lock(ALIVE, 2500)
    api.checkpoint(ALIVE)
    api.restore(ALIVE)
    api.unlock(ALIVE)
    assert b.calls == [
        ("version",),
        ("init",),
        ("lock", ALIVE, 2500),
        ("checkpoint", ALIVE),
        ("restore", ALIVE, []),
        ("unlock", ALIVE),
    ]


@pytest.mark.parametrize(
    ("value", "state"),
    [
        (0, ProcessState.RUNNING),
        (1, ProcessState.LOCKED),
        (2, ProcessState.CHECKPOINTED),
        (3, ProcessState.FAILED),
    ],
)
def test_state_values(value: int, state: ProcessState) -> None:
    assert DriverApi(FakeBinding(state_value=value)).state(ALIVE) is state


def test_a_custom_storage_state_means_someone_else_is_at_work() -> None:
    with pytest.raises(GpuFailedPrecondition, match="another tool"):
        DriverApi(FakeBinding(state_value=4)).state(ALIVE)


@pytest.mark.parametrize(
    ("call", "code", "cls", "fragment"),
    [
        ("lock", 401, GpuFailedPrecondition, "wrong state for lock"),
        ("checkpoint", 401, GpuFailedPrecondition, "wrong state for checkpoint"),
        ("lock", 600, GpuDeadlineExceeded, "did not finish within 2500 ms"),
        ("lock", 909, GpuDeadlineExceeded, "process keeps running"),
        ("checkpoint", 801, GpuUnimplemented, "UVM or CUDA IPC memory"),
        ("lock", 3, GpuUnavailable, "persistence mode"),
        ("unlock", 100, GpuUnavailable, "/dev/nvidia"),
        ("get_state", 1, GpuNotFound, "not a CUDA process"),
        ("get_state", 801, GpuNotFound, "not a CUDA process"),
        ("get_state", 999, GpuNotFound, "not a CUDA process"),
        ("get_state", 3, GpuUnavailable, "not usable from the shim"),
        ("restore", 1, GpuInvalidArgument, "rejected the device map"),
        ("checkpoint", 999, GpuInternal, "CUDA_ERROR_999 (CUresult 999)"),
    ],
)
def test_cuda_errors_become_typed_errors_naming_pid_and_step(
    call: str, code: int, cls: type[GpuError], fragment: str
) -> None:
    api = DriverApi(FakeBinding(codes={call: code}))
    step = Step.STATE if call == "get_state" else Step(call)
    with pytest.raises(cls) as info:
        if call == "lock":
            api.lock(ALIVE, 2500)
        elif call == "get_state":
            api.state(ALIVE)
        elif call == "restore":
            api.restore(ALIVE, {OLD: NEW})
        else:
            getattr(api, call)(ALIVE)
    assert type(info.value) is cls
    assert (info.value.pid, info.value.step) == (ALIVE, step)
    assert str(info.value).startswith(f"GPU {step} of pid {ALIVE}: ")
    assert fragment in str(info.value)


def test_a_wrong_transition_says_what_state_the_process_is_in() -> None:
    api = DriverApi(FakeBinding(codes={"checkpoint": 401}, state_value=0))
    with pytest.raises(GpuFailedPrecondition, match="the process is running"):
        api.checkpoint(ALIVE)


def test_an_error_on_a_gone_process_is_process_exited() -> None:
    with pytest.raises(GpuProcessExited, match="has exited"):
        DriverApi(FakeBinding(codes={"lock": 1})).lock(GONE, 100)


def test_zero_lock_timeout_is_refused_before_the_driver() -> None:
    b = FakeBinding()
    with pytest.raises(GpuInvalidArgument):
        DriverApi(b).lock(ALIVE, 0)
    assert not any(c[0] == "lock" for c in b.calls)


def test_device_map_becomes_raw_uuid_pairs() -> None:
    b = FakeBinding()
    DriverApi(b).restore(ALIVE, {OLD: NEW})
    assert b.calls[-1] == (
        "restore",
        ALIVE,
        [(uuid.UUID(OLD[4:]).bytes, uuid.UUID(NEW[4:]).bytes)],
    )


@pytest.mark.parametrize("bad", ["GPU-xyz", "MIG-4bd1d1e2-8f3c-4e0a-a0b9-7f1f63a3e0c1/1/0"])
def test_a_malformed_device_map_is_refused(bad: str) -> None:
    with pytest.raises(GpuInvalidArgument, match="not a GPU UUID"):
        DriverApi(FakeBinding()).restore(ALIVE, {bad: NEW})
    assert uuid_bytes(OLD) == uuid_bytes(OLD[4:])


def test_a_driver_older_than_570_is_unavailable() -> None:
    with pytest.raises(
        GpuUnavailable, match=r"CUDA 12\.4; the checkpoint API needs NVIDIA driver >= 570"
    ):
        DriverApi(FakeBinding(version=12040))


def test_a_binding_that_cannot_reach_the_driver_is_unavailable() -> None:
    with pytest.raises(GpuUnavailable, match="no NVIDIA driver"):
        DriverApi(FakeBinding(raise_on="version"))
    api = DriverApi(FakeBinding(raise_on="lock"))
    with pytest.raises(GpuUnavailable, match="Function not found"):
        api.lock(ALIVE, 10)


def test_cuinit_runs_once_even_from_many_threads() -> None:
    b = FakeBinding()
    api = DriverApi(b)
    threads = [threading.Thread(target=api.state, args=(ALIVE,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [c for c in b.calls if c[0] == "init"] == [("init",)]


def test_available_reports_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> driver_api.Binding:
        raise GpuUnavailable("no NVIDIA driver: cannot load libcuda.so.1")

    monkeypatch.setattr(driver_api, "load_binding", no_driver)
    availability = DriverApi.available()
    assert not availability
    assert "libcuda.so.1" in availability.detail
    monkeypatch.setattr(driver_api, "load_binding", lambda: FakeBinding(version=12090))
    assert DriverApi.available().detail == "CUDA 12.9 driver API via fake"


def test_load_binding_without_bindings_or_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_module(name: str) -> Any:
        raise ImportError(name)

    def no_lib(name: str) -> Any:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(driver_api.importlib, "import_module", no_module)
    monkeypatch.setattr(driver_api.ctypes, "CDLL", no_lib)
    with pytest.raises(GpuUnavailable, match=r"cannot load libcuda\.so\.1"):
        driver_api.load_binding()


# -- cuda-bindings adapter ------------------------------------------------------------


class _Struct:
    """A cuda-bindings struct: fields as attributes, getPtr() to its C memory."""

    SIZE = 64

    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(self.SIZE)

    def getPtr(self) -> int:
        return ctypes.addressof(self._buf)

    @property
    def raw(self) -> bytes:
        return self._buf.raw


class FakeCudaModule:
    """Shaped like ``cuda.bindings.driver``: each call returns (CUresult, *outputs)."""

    __name__ = "cuda.bindings.driver"

    class CUcheckpointGpuPair(_Struct):
        SIZE = 32

    class CUcheckpointLockArgs:
        timeoutMs = 0

    class CUcheckpointRestoreArgs:
        gpuPairs: list[Any] | None = None
        gpuPairsCount = 0

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    def CUresult(self, code: int) -> int:
        return code

    def cuDriverGetVersion(self) -> tuple[int, int]:
        return 0, 13000

    def cuInit(self, flags: int) -> tuple[int]:
        return (0,)

    def cuCheckpointProcessGetState(self, pid: int) -> tuple[int, int]:
        return 0, 2

    def cuCheckpointProcessLock(self, pid: int, args: Any) -> tuple[int]:
        self.seen.append(("lock", pid, args.timeoutMs))
        return (0,)

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> tuple[int]:
        self.seen.append(("checkpoint", pid, args))
        return (0,)

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> tuple[int]:
        pairs = None if args is None else [p.raw for p in args.gpuPairs]
        self.seen.append(("restore", pid, pairs, None if args is None else args.gpuPairsCount))
        return (401,)

    def cuCheckpointProcessUnlock(self, pid: int, args: Any) -> tuple[int]:
        self.seen.append(("unlock", pid, args))
        return (0,)

    def cuGetErrorName(self, code: int) -> tuple[int, bytes]:
        return 0, b"CUDA_ERROR_ILLEGAL_STATE"


def test_cuda_bindings_adapter() -> None:
    module = FakeCudaModule()
    b = CudaBindings(module)
    assert b.driver_version() == (0, 13000)
    assert b.get_state(7) == (0, 2)
    assert b.lock(7, 1234) == 0
    assert b.checkpoint(7) == 0
    assert b.unlock(7) == 0
    assert b.restore(7, []) == 401
    old, new = uuid_bytes(OLD), uuid_bytes(NEW)
    b.restore(7, [(old, new)])
    assert b.error_name(401) == "CUDA_ERROR_ILLEGAL_STATE"
    assert module.seen == [
        ("lock", 7, 1234),
        ("checkpoint", 7, None),
        ("unlock", 7, None),
        ("restore", 7, None, None),
        ("restore", 7, [old + new], 1),
    ]
    assert b.source.startswith("cuda.bindings.driver (cuda-bindings ")


# -- libcuda through ctypes -------------------------------------------------------------


class FakeFunction:
    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.argtypes: Any = None
        self.restype: Any = None

    def __call__(self, *args: Any) -> int:
        return int(self.fn(*args))


class FakeLibcuda:
    """libcuda's C ABI: out-parameters by address, args structs read from raw memory."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []
        self.cuDriverGetVersion = FakeFunction(self._version)
        self.cuInit = FakeFunction(lambda flags: 0)
        self.cuGetErrorName = FakeFunction(self._error_name)
        self.cuCheckpointProcessGetState = FakeFunction(self._get_state)
        self.cuCheckpointProcessLock = FakeFunction(self._lock)
        self.cuCheckpointProcessCheckpoint = FakeFunction(lambda pid, args: 0)
        self.cuCheckpointProcessRestore = FakeFunction(self._restore)
        self.cuCheckpointProcessUnlock = FakeFunction(lambda pid, args: 0)
        self._names: list[Any] = []

    def _version(self, out: Any) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = 12080
        return 0

    def _get_state(self, pid: int, out: int) -> int:
        ctypes.c_int.from_address(out).value = 1
        return 0

    def _lock(self, pid: int, args: int) -> int:
        raw = ctypes.string_at(args, 64)
        self.seen.append(("lock", pid, raw))
        return 0

    def _restore(self, pid: int, args: int | None) -> int:
        if args is None:
            self.seen.append(("restore", pid, None))
            return 0
        raw = ctypes.string_at(args, 64)
        pointer = int.from_bytes(raw[0:8], "little")
        count = int.from_bytes(raw[8:12], "little")
        self.seen.append(("restore", pid, ctypes.string_at(pointer, 32 * count), raw[12:]))
        return 0

    def _error_name(self, code: int, out: Any) -> int:
        name = ctypes.c_char_p(b"CUDA_ERROR_NOT_READY")
        self._names.append(name)
        out._obj.value = name.value
        return 0


def test_libcuda_binding_passes_the_c_structs_the_driver_expects() -> None:
    lib = FakeLibcuda()
    b = LibcudaBinding(lib)
    assert b.driver_version() == (0, 12080)
    assert b.get_state(9) == (0, 1)
    assert b.lock(9, 3000) == 0
    old, new = uuid_bytes(OLD), uuid_bytes(NEW)
    assert b.restore(9, [(old, new), (new, old)]) == 0
    assert b.restore(9, []) == 0
    lock_raw = lib.seen[0][2]
    # timeoutMs comes first, every reserved field is zero.
    assert int.from_bytes(lock_raw[0:4], "little") == 3000
    assert lock_raw[4:] == bytes(60)
    assert lib.seen[1] == ("restore", 9, old + new + new + old, bytes(52))
    assert lib.seen[2] == ("restore", 9, None)
    assert lib.cuCheckpointProcessLock.restype is ctypes.c_int
    assert b.error_name(600) == "CUDA_ERROR_NOT_READY"


def test_a_libcuda_without_the_checkpoint_api_is_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Old:
        def __getattr__(self, name: str) -> Any:
            raise AttributeError(f"libcuda.so.1: undefined symbol: {name}")

    def no_module(name: str) -> Any:
        raise ImportError(name)

    monkeypatch.setattr(driver_api.importlib, "import_module", no_module)
    monkeypatch.setattr(driver_api.ctypes, "CDLL", lambda name: Old())
    with pytest.raises(GpuUnavailable, match="driver >= 570"):
        driver_api.load_binding()

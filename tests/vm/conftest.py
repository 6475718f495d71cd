"""The VM tier's suite: what real nodes run and this host does not (cgroup v2 only with
systemd, a kernel that tracks dirty pages, root with CAP_SYS_RESOURCE), run inside the
guest `tests/vm/machine/vm.py` boots (`make vm-test`).

Everything is real, as in tests/integration (whose harness it uses): containerd 1.7 and
2.1, runc with the systemd cgroup driver for the CRI, CRIU, Slurm. Every test carries
the `cgroup_v2` marker: on a cgroup v1 host the whole suite skips, saying so.
"""

from __future__ import annotations

import os

# Before the harness is imported (its CRI client reads it once): the guest runs code
# 20-50x slower than the host, more with the host loaded; every bound the harness puts
# on a step is stretched by this much.
os.environ.setdefault("CEDANA_TEST_SLOWER", "10")

import re
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from types import FrameType

import pytest
from integration.harness.config import (
    CONTAINERD_VERSIONS,
    CRI_NAMESPACE,
    CTR_NAMESPACE,
    ContainerdVersion,
    Runtime,
    runtime_under_test,
    selected_versions,
)
from integration.harness.containerd import Containerd, make_containerd
from integration.harness.cri import CriClient
from integration.harness.ctr import Ctr
from integration.harness.images import TestImages, build_test_images
from support.cgroup_version import skip_other_version

from .nodes import Figures, SystemdNode

_HERE = Path(__file__).parent
# containerd 1.6's CRI cannot run the handler as a runc-type runtime (no SystemdCgroup).
VM_VERSIONS = tuple(v for v in CONTAINERD_VERSIONS if v.major_minor >= (1, 7))
# The guest runs code 20-50x slower than the host: a hung test still fails, later.
_TEST_TIMEOUT = float(os.environ.get("CEDANA_TEST_TIMEOUT", "900"))
_LIVE: list[Containerd] = []
_LOG_OFFSETS = pytest.StashKey[dict[int, int]]()
_FIGURES = Figures()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "vm_containerd(*short): the containerd versions a test of the VM tier runs on "
        '(e.g. "1.7", "2.1"); without it, the newest one selected (the guest is slow: '
        "what does not depend on containerd's version runs once)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    newest = _versions()[-1].short
    for item in items:
        if _HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.cgroup_v2)
        callspec = getattr(item, "callspec", None)
        version = callspec.params.get("ctrd_version") if callspec is not None else None
        marker = item.get_closest_marker("vm_containerd")
        wanted = marker.args if marker is not None else (newest,)
        if isinstance(version, ContainerdVersion) and version.short not in wanted:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    skip_other_version(item)
    if os.geteuid() != 0:
        pytest.fail(f"{item.nodeid} drives containerd, runc and CRIU: run tests/vm as root")
    item.stash[_LOG_OFFSETS] = {id(c): c.log_offset() for c in _LIVE}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"test exceeded {_TEST_TIMEOUT:.0f}s (CEDANA_TEST_TIMEOUT)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, _TEST_TIMEOUT)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    report = outcome.get_result()
    if not report.failed or report.when == "teardown":
        return
    offsets = item.stash.get(_LOG_OFFSETS, {})
    for instance in _LIVE:
        text = instance.log_since(offsets.get(id(instance), 0), limit=60_000)
        report.sections.append((f"containerd {instance.version.full} log", text))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A failure is shown as it happens: the tier runs for many minutes."""
    if report.failed:
        print(
            f"\n---- {report.nodeid} failed ({report.when}):\n{report.longreprtext}\n", flush=True
        )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES.lines:
        terminalreporter.section("figures measured in the VM")
        for line in _FIGURES.lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def figures() -> Figures:
    return _FIGURES


def _versions() -> tuple[ContainerdVersion, ...]:
    wanted = {v.short for v in selected_versions()}
    return tuple(v for v in VM_VERSIONS if v.short in wanted) or VM_VERSIONS[-1:]


@pytest.fixture(scope="session")
def runtime() -> Runtime:
    return runtime_under_test()


@pytest.fixture(scope="session")
def vm_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="cedana-vmtest-"))
    yield root
    subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=False)


@pytest.fixture(scope="session")
def test_images(vm_root: Path) -> TestImages:
    workdir = vm_root / "images"
    workdir.mkdir()
    return build_test_images(workdir)


@pytest.fixture(scope="session", params=_versions(), ids=lambda v: v.id)
def ctrd_version(request: pytest.FixtureRequest) -> ContainerdVersion:
    version: ContainerdVersion = request.param
    return version


@pytest.fixture(scope="session")
def containerd(
    ctrd_version: ContainerdVersion, runtime: Runtime, test_images: TestImages, vm_root: Path
) -> Iterator[Containerd]:
    instance = make_containerd(
        ctrd_version,
        runtime,
        test_images,
        vm_root,
        (CTR_NAMESPACE, CRI_NAMESPACE),
        factory=SystemdNode,
    )
    _LIVE.append(instance)
    try:
        yield instance
    finally:
        _LIVE.remove(instance)
        notes = instance.cleanup()
        if notes:
            print(f"\n[teardown {instance.version.id}] " + "; ".join(notes))


@pytest.fixture
def ctr(containerd: Containerd) -> Ctr:
    return containerd.ctr(CTR_NAMESPACE)


@pytest.fixture
def cri(containerd: Containerd) -> Iterator[CriClient]:
    client = containerd.cri()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def new_id(request: pytest.FixtureRequest) -> Callable[[str], str]:
    name = request.node.name.split("[")[0].removeprefix("test_")[:20]
    prefix = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")

    def make(tag: str = "c") -> str:
        return f"{prefix}-{tag}-{uuid.uuid4().hex[:8]}"

    return make

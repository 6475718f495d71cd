"""Fixtures for the integration suite.

Every test runs once per containerd version (ids `ctrd-1.6`, `ctrd-1.7`, `ctrd-2.1`)
against the runtime chosen by `CEDANA_TEST_RUNTIME` (default `cedana`; `runc` drives
containerd's own shim with the very same tests, as the reference behaviour).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from types import FrameType

import pytest
from support.cgroup_version import skip_other_version

from .harness.config import (
    CRI_NAMESPACE,
    CTR_NAMESPACE,
    ContainerdVersion,
    Runtime,
    runtime_under_test,
    selected_versions,
)
from .harness.containerd import Containerd, make_containerd
from .harness.cri import CriClient
from .harness.ctr import Ctr
from .harness.images import TestImages, build_test_images
from .harness.registry import (
    PASSWORD,
    PREFIX,
    USER,
    Registry,
    TlsFiles,
    make_test_ca,
    write_auth_file,
)

_LIVE: list[Containerd] = []
_LOG_OFFSETS = pytest.StashKey[dict[int, int]]()
# A hung RPC or a container that never exits must fail one test, not stall the suite.
_TEST_TIMEOUT = float(os.environ.get("CEDANA_TEST_TIMEOUT", "180"))


def pytest_report_header(config: pytest.Config) -> list[str]:
    rt = runtime_under_test()
    versions = ", ".join(v.full for v in selected_versions())
    return [
        f"cedana-shim integration: runtime={rt.handler} ({rt.runtime_type}); containerd {versions}"
    ]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "ctrd_versions(*short): run this test only on these containerd versions (e.g. "
        '"1.6", "2.1"); when CEDANA_TEST_CONTAINERD selects none of them, on the newest '
        "selected version instead",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)
    _narrow_versions(config, items)


def _narrow_versions(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect (not skip) the versions a `ctrd_versions`-marked test does not run on."""
    selected = [v.short for v in selected_versions()]
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        marker = item.get_closest_marker("ctrd_versions")
        callspec = getattr(item, "callspec", None)
        version = callspec.params.get("ctrd_version") if callspec is not None else None
        if marker is None or not isinstance(version, ContainerdVersion):
            keep.append(item)
            continue
        wanted = [v for v in marker.args if v in selected] or selected[-1:]
        (keep if version.short in wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    skip_other_version(item)
    item.stash[_LOG_OFFSETS] = {id(c): c.log_offset() for c in _LIVE}


class TestTimeout(Exception):
    pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise TestTimeout(f"test exceeded {_TEST_TIMEOUT:.0f}s (CEDANA_TEST_TIMEOUT)")

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
        text = instance.log_since(offsets.get(id(instance), 0))
        report.sections.append(
            (f"containerd {instance.version.full} log ({instance.log_path})", text)
        )


# -- session-wide inputs --------------------------------------------------------------


@pytest.fixture(scope="session")
def runtime() -> Runtime:
    if os.geteuid() != 0:
        pytest.fail("the integration suite drives containerd and runc: run it as root")
    return runtime_under_test()


@pytest.fixture(scope="session")
def itest_root() -> Iterator[Path]:
    parent = os.environ.get("CEDANA_TEST_TMPDIR", "/tmp")
    root = Path(tempfile.mkdtemp(prefix="cedana-itest-", dir=parent))
    yield root
    if not os.environ.get("CEDANA_TEST_KEEP"):
        subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=False)


@pytest.fixture(scope="session")
def test_images(itest_root: Path) -> TestImages:
    workdir = itest_root / "images"
    workdir.mkdir()
    return build_test_images(workdir)


@pytest.fixture(scope="session", params=selected_versions(), ids=lambda v: v.id)
def ctrd_version(request: pytest.FixtureRequest) -> ContainerdVersion:
    version: ContainerdVersion = request.param
    return version


# -- containerd instances -------------------------------------------------------------


def _instance(
    version: ContainerdVersion,
    runtime: Runtime,
    images: TestImages,
    parent: Path,
    namespaces: tuple[str, ...],
) -> Iterator[Containerd]:
    instance = make_containerd(version, runtime, images, parent, namespaces)
    _LIVE.append(instance)
    try:
        yield instance
    finally:
        _cleanup(instance)


def _cleanup(instance: Containerd) -> None:
    _LIVE.remove(instance)
    notes = instance.cleanup(keep_base=bool(os.environ.get("CEDANA_TEST_KEEP")))
    if notes:
        print(f"\n[teardown {instance.version.id}] " + "; ".join(notes))


@pytest.fixture(scope="session")
def containerd(
    ctrd_version: ContainerdVersion, runtime: Runtime, test_images: TestImages, itest_root: Path
) -> Iterator[Containerd]:
    """The shared containerd of one version, with both test images in the ctr test
    namespace and in k8s.io (image import is the expensive part, boot is ~30 ms)."""
    yield from _instance(
        ctrd_version, runtime, test_images, itest_root, (CTR_NAMESPACE, CRI_NAMESPACE)
    )


@pytest.fixture
def fresh_containerd(
    ctrd_version: ContainerdVersion, runtime: Runtime, test_images: TestImages, itest_root: Path
) -> Iterator[Containerd]:
    """A containerd of its own, for tests that restart it or kill shims and then assert
    on everything under its state dir."""
    yield from _instance(ctrd_version, runtime, test_images, itest_root, (CTR_NAMESPACE,))


MakeNode = Callable[[dict[str, str]], Containerd]


@pytest.fixture
def make_node(
    ctrd_version: ContainerdVersion, runtime: Runtime, test_images: TestImages, itest_root: Path
) -> Iterator[MakeNode]:
    """Containerds of their own ("nodes": separate roots, stores and shims), each with
    `env` added to its environment (node config keys as CEDANA_<KEY>); all removed at
    the end. Images are in the ctr test namespace and in k8s.io."""
    made: list[Containerd] = []

    def make(env: dict[str, str]) -> Containerd:
        namespaces = (CTR_NAMESPACE, CRI_NAMESPACE)
        instance = make_containerd(ctrd_version, runtime, test_images, itest_root, namespaces, env)
        _LIVE.append(instance)
        made.append(instance)
        return instance

    try:
        yield make
    finally:
        for instance in made:
            _cleanup(instance)


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
    """Unique container ids: runc's state root (/run/containerd/runc/<ns>) is shared by
    every containerd on the host."""
    name = request.node.name.split("[")[0].removeprefix("test_")[:20]
    # containerd ids must match ^[A-Za-z0-9]+(?:[._-](?:[A-Za-z0-9]+))*$
    prefix = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")

    def make(tag: str = "c") -> str:
        return f"{prefix}-{tag}-{uuid.uuid4().hex[:8]}"

    return make


# -- a registry for the tests that move checkpoints between nodes ------------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_test_ca(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def registry(tmp_path: Path, tls: TlsFiles) -> Iterator[Registry]:
    """Debian's docker-registry with TLS and htpasswd auth, for one test."""
    reg = Registry(tmp_path / "registry", tls=tls)
    reg.start()
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture
def node_env(tmp_path: Path, registry: Registry, tls: TlsFiles) -> dict[str, str]:
    """The node config (as CEDANA_* variables) that reaches ``registry``."""
    auth = write_auth_file(tmp_path / "registry-auth.json", registry.host, USER, PASSWORD)
    return {
        "CEDANA_REGISTRY": f"{registry.host}/{PREFIX}",
        "CEDANA_REGISTRY_AUTH_FILE": str(auth),
        "CEDANA_REGISTRY_CA": str(tls.ca_cert),
        "CEDANA_REGISTRY_TIMEOUT": "10",
    }

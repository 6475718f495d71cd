"""The cgroup a restore hands CRIU as its root on a cgroup v2 node (runtime/cgroup_root.py),
and that ``runc restore`` passes it to CRIU, against a fake runc."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cedana_shim.runtime import cgroup_root
from cedana_shim.runtime.reaper import Reaper
from cedana_shim.runtime.runc import RestoreOpts, Runc
from support.processes import run_with_reaper


@pytest.mark.parametrize(
    ("slice_name", "path"),
    [
        ("system.slice", "/system.slice"),
        ("-.slice", "/"),
        ("kubepods.slice", "/kubepods.slice"),
        (
            "kubepods-besteffort-pod1234.slice",
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1234.slice",
        ),
    ],
)
def test_expand_slice(slice_name: str, path: str) -> None:
    assert cgroup_root.expand_slice(slice_name) == path


@pytest.mark.parametrize("bad", ["kubepods", ".slice", "a--b.slice", "-a.slice", "a/b.slice"])
def test_expand_slice_refuses_what_systemd_refuses(bad: str) -> None:
    with pytest.raises(ValueError, match="slice name"):
        cgroup_root.expand_slice(bad)


def _spec(cgroups_path: str | None) -> dict[str, object]:
    return {"linux": {} if cgroups_path is None else {"cgroupsPath": cgroups_path}}


@pytest.mark.parametrize(
    ("cgroups_path", "systemd", "own", "expected"),
    [
        # ctr: containerd's default spec, the cgroupfs driver
        ("/default/c2", False, "/x/y", "/default/c2"),
        # kubelet's pod cgroup with the systemd driver (containerd's CRI)
        (
            "kubepods-besteffort-pod42.slice:cri-containerd:abc",
            True,
            "/",
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod42.slice/"
            "cri-containerd-abc.scope",
        ),
        (":cri-containerd:abc", True, "/", "/system.slice/cri-containerd-abc.scope"),
        ("machine.slice::abc", True, "/", "/machine.slice/abc.scope"),
        ("machine.slice:x:sub.slice", True, "/", "/machine.slice/sub.slice"),
        (None, True, "/", "/system.slice/runc-c2.scope"),
        # relative or none with cgroupfs: under the parent of runc's own cgroup
        ("pods/c2", False, "/system.slice/containerd.service", "/system.slice/pods/c2"),
        (None, False, "/a/b", "/a/c2"),
        ("/a/../b//c/", False, "/", "/b/c"),
    ],
)
def test_container_cgroup_is_what_runc_names(
    cgroups_path: str | None, systemd: bool, own: str, expected: str
) -> None:
    spec = _spec(cgroups_path)
    assert cgroup_root.container_cgroup(spec, "c2", systemd=systemd, own_cgroup=own) == expected


def test_a_systemd_path_that_is_not_slice_prefix_name_is_refused() -> None:
    with pytest.raises(ValueError, match="slice:prefix:name"):
        cgroup_root.container_cgroup(_spec("/default/c2"), "c2", systemd=True)


def test_own_cgroup_reads_the_unified_line(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "cgroup").write_text("0::/system.slice/containerd.service\n")
    assert cgroup_root.own_cgroup(str(tmp_path)) == "/system.slice/containerd.service"


def test_unified_is_told_by_the_root_s_cgroup_controllers(tmp_path: Path) -> None:
    assert not cgroup_root.unified(str(tmp_path))
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    assert cgroup_root.unified(str(tmp_path))


FAKE_RUNC = f"""#!{sys.executable}
import json, os, sys
config = os.environ.get("CRIU_CONFIG_FILE")
record = {{"config": config, "text": open(config).read() if config else None}}
with open(os.path.join(os.path.dirname(sys.argv[0]), "calls.jsonl"), "a") as f:
    f.write(json.dumps(record) + "\\n")
"""


def _restore_env_seen(tmp_path: Path, *, systemd: bool) -> dict[str, str | None]:
    runc = tmp_path / "runc"
    runc.write_text(FAKE_RUNC)
    runc.chmod(0o755)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    path = "kubepods-pod9.slice:cri-containerd:c2" if systemd else "/default/c2"
    (bundle / "config.json").write_text(json.dumps(_spec(path)))

    async def body(reaper: Reaper) -> None:
        driver = Runc(reaper=reaper, root=str(tmp_path / "root"), binary=str(runc))
        driver.systemd_cgroup = systemd
        await driver.restore("c2", RestoreOpts(bundle=str(bundle), image_path=str(tmp_path)))

    run_with_reaper(body)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 1
    return dict(calls[0])


@pytest.mark.parametrize("systemd", [False, True])
def test_restore_on_cgroup_v2_names_the_new_container_s_cgroup_to_criu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, systemd: bool
) -> None:
    monkeypatch.setattr(cgroup_root, "unified", lambda: True)
    seen = _restore_env_seen(tmp_path, systemd=systemd)
    expected = (
        "/kubepods.slice/kubepods-pod9.slice/cri-containerd-c2.scope" if systemd else "/default/c2"
    )
    assert seen["config"] == str(tmp_path / "bundle" / cgroup_root.CONFIG_FILE)
    assert seen["text"] == f"cgroup-root :{expected}\n"


def test_restore_on_cgroup_v1_leaves_criu_s_cgroups_to_runc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cgroup_root, "unified", lambda: False)
    assert _restore_env_seen(tmp_path, systemd=False) == {"config": None, "text": None}

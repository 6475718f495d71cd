"""`cedana doctor` reports what this node has, and fails loudly on what it lacks."""

import json
import os
from pathlib import Path

import pytest
from cedana_shim.cli.admin import main
from cedana_shim.cli.admin_doctor import check_store, shared_filesystem_note
from support.capabilities import prlimit_of_another_user_works


def test_doctor_on_this_node_is_ready(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["doctor", "--json", "--store", str(tmp_path / "store")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ready"] is True
    assert report["criu"]["ok"] and report["criu"]["version"] >= "4.2"
    assert report["criu"]["inetSockets"] is True  # a real dump of a TCP socket
    assert report["runc"]["ok"]
    # No GPU here: reported as such, and not a reason to fail a CPU node.
    assert report["gpu"]["devices"] == []
    # The cost-changing features as the kernel itself tells them: userfaultfd exists
    # with its sysctl; pagemap shows soft-dirty bits only with CONFIG_MEM_SOFT_DIRTY.
    features = report["criu"]["features"]
    assert (
        features["lazyPages"]["available"] is Path("/proc/sys/vm/unprivileged_userfaultfd").exists()
    )
    assert features["dirtyTracking"]["available"] is _soft_dirty()


def test_doctor_says_whether_criu_can_dump_a_process_of_another_user(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """What the report says is what the kernel does: root's prlimit(2) on a process of
    uid 1000 (CRIU reads every process's limits so) works exactly when the report says
    CAP_SYS_RESOURCE is there. (The containerds the report looks at were started on
    this machine by root, as this test was: they have its bounding set.) On the machines
    this project is tested on it is missing, and the text says what that means."""
    assert main(["doctor", "--json", "--store", str(tmp_path / "store")]) == 0
    (sys_resource,) = json.loads(capsys.readouterr().out)["capabilities"].values()
    assert sys_resource["available"] is prlimit_of_another_user_works()
    if not sys_resource["available"]:
        assert sys_resource["meaning"].startswith("CAP_SYS_RESOURCE is missing"), sys_resource
        assert "does not run as root" in sys_resource["meaning"]
    assert main(["doctor", "--store", str(tmp_path / "store")]) == 0
    assert f"caps   {sys_resource['meaning']}" in capsys.readouterr().out


def _soft_dirty() -> bool:
    """Whether a page written after its soft-dirty bit was cleared shows the bit again
    in pagemap (bit 55): always 0 in a kernel without CONFIG_MEM_SOFT_DIRTY."""
    import ctypes
    import mmap
    import struct

    page = mmap.mmap(-1, mmap.PAGESIZE)
    page[0] = 1
    Path("/proc/self/clear_refs").write_text("4")
    page[0] = 2
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(address // mmap.PAGESIZE * 8)
        (entry,) = struct.unpack("<Q", pagemap.read(8))
    return bool(entry >> 55 & 1)


def test_store_with_open_permissions_is_a_problem(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o755)
    os.chmod(store, 0o755)
    report = check_store(str(store))
    assert report["ok"] is False
    assert "0700" in report["problem"]
    os.chmod(store, 0o700)
    report = check_store(str(store))
    assert report["ok"] is True
    # A local filesystem, named as `stat -f` names it, and nothing to say about it.
    assert report["filesystem"] in ("ext2/ext3", "tmpfs", "xfs", "btrfs", "overlayfs")
    assert "note" not in report


@pytest.mark.parametrize("fstype", ["nfs", "lustre", "ceph"])
def test_a_store_on_a_shared_filesystem_is_pointed_at_the_shared_directory(fstype: str) -> None:
    note = shared_filesystem_note("/scratch/cedana", fstype)
    assert f"/scratch/cedana is on {fstype}" in note and "set registry to a directory" in note
    assert shared_filesystem_note("/var/lib/cedana", "ext2/ext3") == ""

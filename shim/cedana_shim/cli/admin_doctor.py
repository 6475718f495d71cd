"""``cedana doctor``: is this node ready to checkpoint and restore containers?

Checks what the shim relies on — CRIU >= 4.1 that works on this kernel and can
dump a process holding a TCP socket (a real dump, see node.criu_probe), runc,
the checkpoint store's location and permissions, and for GPU nodes the NVIDIA
driver, the CUDA checkpoint API or ``cuda-checkpoint``, and the devices — and
says for each missing piece what to do. It also says what the node's capability
bounding set lets CRIU dump (CAP_SYS_RESOURCE: processes of other users), and the
node's cgroup version and driver.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from typing import Any

CRIU_MIN = (4, 1)
TIMEOUT = 20.0


def _run(argv: list[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return 127, str(err)
    return done.returncode, (done.stdout + done.stderr).strip()


def check_criu() -> dict[str, Any]:
    path = shutil.which("criu", path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    if path is None:
        return {
            "ok": False,
            "problem": "criu is not installed: install CRIU >= 4.2 (make setup "
            "builds it from Debian sid's source into /usr/local/sbin/criu)",
        }
    code, out = _run([path, "--version"])
    match = re.search(r"Version:\s*(\d+)\.(\d+)", out)
    version = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    report: dict[str, Any] = {"path": path, "version": ".".join(map(str, version))}
    if version < CRIU_MIN:
        report.update(
            ok=False,
            problem=f"{path} is CRIU {report['version']}; this shim needs "
            ">= 4.1 (3.x fails on current kernels: 'Unexpected rt vDSO area bounds')",
        )
        return report
    code, out = _run([path, "check"])
    report["check"] = out.splitlines()[-1] if out else ""
    report["ok"] = code == 0
    if code != 0:
        report["problem"] = f"`criu check` failed: {report['check']}"
        return report
    from ..node.criu_probe import probe_inet_dump

    problem = probe_inet_dump(path)
    report["inetSockets"] = problem is None
    if problem is not None:
        report.update(ok=False, problem=problem)
    report["features"] = criu_features(path)
    return report


# CRIU features that change what a checkpoint costs here, not whether it works:
# (name in `criu check --feature`, what it gives, what the node does without it).
CRIU_FEATURES = (
    (
        "uffd-noncoop",
        "lazyPages",
        "lazy restore (node config lazy_restore): the tasks run before all their memory is in",
        "restores are eager: all memory is read before the tasks run",
    ),
    (
        "mem_dirty_track",
        "dirtyTracking",
        "the kernel tracks dirty pages (CONFIG_MEM_SOFT_DIRTY): with dirty_tracking = "
        "auto a container's next dump freezes it only for the pages it wrote since its "
        "last checkpoint; periodic checkpoints store and upload only the chunks that "
        "changed",
        "no dirty-page tracking in this kernel (CONFIG_MEM_SOFT_DIRTY): every dump "
        "freezes the container for all of its memory; periodic checkpoints still store "
        "and upload only the chunks that changed",
    ),
)


def criu_features(path: str) -> dict[str, dict[str, Any]]:
    """Each of CRIU_FEATURES: whether this kernel and CRIU have it, and what that means."""
    out: dict[str, dict[str, Any]] = {}
    for feature, key, with_it, without_it in CRIU_FEATURES:
        code, _ = _run([path, "check", "--feature", feature])
        out[key] = {"available": code == 0, "meaning": with_it if code == 0 else without_it}
    return out


SYS_RESOURCE_WITH = (
    "CAP_SYS_RESOURCE is in the capability bounding set: CRIU can dump processes of any user"
)
SYS_RESOURCE_WITHOUT = (
    "CAP_SYS_RESOURCE is missing from the capability bounding set: a container with a "
    "process that does not run as root (most databases and web servers drop root) cannot "
    "be checkpointed, and its checkpoint fails at once saying so; add CAP_SYS_RESOURCE to "
    "the bounding set containerd runs with (systemd: CapabilityBoundingSet= in its unit)"
)


def check_capabilities(proc: str = "/proc") -> dict[str, Any]:
    """CAP_SYS_RESOURCE in the bounding set of containerd (which the shims, and CRIU
    under them, inherit), or of this process when no containerd is visible."""
    from ..checkpoint.preflight import has_sys_resource

    pids = _containerd_pids(proc)
    try:
        whose: list[int | str] = [*pids] or ["self"]
        available = all(has_sys_resource(pid, proc) for pid in whose)
    except OSError as err:
        return {"sysResource": {"available": None, "meaning": f"cannot tell: {err}"}}
    checked = f"containerd (pid {', '.join(map(str, pids))})" if pids else "cedana doctor"
    meaning = SYS_RESOURCE_WITH if available else SYS_RESOURCE_WITHOUT
    return {"sysResource": {"available": available, "checked": checked, "meaning": meaning}}


def _containerd_pids(proc: str) -> list[int]:
    pids = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "comm")) as f:
                if f.read().strip() == "containerd":
                    pids.append(int(name))
        except OSError:
            continue
    return sorted(pids)


CGROUP_ROOT = "/sys/fs/cgroup"


def check_cgroups(root: str = CGROUP_ROOT, proc: str = "/proc") -> dict[str, Any]:
    """The node's cgroup version and who manages the hierarchy, which decides the cgroup
    driver kubelet and runc must use (and that a restore lands in the new container's
    cgroup: on cgroup v2 the shim names it to CRIU, runtime/cgroup_root.py)."""
    unified = os.path.join(root, "cgroup.controllers")
    try:
        with open(unified) as f:
            version, controllers = 2, f.read().split()
    except FileNotFoundError:
        version = 1
        try:
            controllers = sorted(
                name for name in os.listdir(root) if os.path.isdir(os.path.join(root, name))
            )
        except OSError:
            controllers = []
    except OSError as err:
        return {"version": None, "meaning": f"cannot read {unified}: {err}"}
    try:
        with open(os.path.join(proc, "1", "comm")) as f:
            systemd = f.read().strip() == "systemd"
    except OSError:
        systemd = False
    driver = "systemd" if systemd else "cgroupfs"
    hierarchy = "cgroup v2 (unified)" if version == 2 else "cgroup v1"
    meaning = (
        f"{hierarchy}, managed by systemd: kubelet's cgroupDriver and runc's SystemdCgroup "
        "must be systemd (kubeadm's default); the cedana handler takes SystemdCgroup from "
        "the node's runc (cedana node install)"
        if systemd
        else f"{hierarchy}, not managed by systemd: the cgroupfs driver (SystemdCgroup = false)"
    )
    return {
        "version": version,
        "controllers": controllers,
        "driver": driver,
        "meaning": meaning,
    }


def check_runc() -> dict[str, Any]:
    path = shutil.which("runc")
    if path is None:
        return {"ok": False, "problem": "runc is not on PATH: install runc (apt-get install runc)"}
    _, out = _run([path, "--version"])
    return {"ok": True, "path": path, "version": out.splitlines()[0] if out else ""}


def check_store(path: str) -> dict[str, Any]:
    report: dict[str, Any] = {"path": path}
    try:
        st = os.stat(path)
    except FileNotFoundError:
        report.update(ok=True, note="not created yet: the shim creates it (0700) on first use")
        return report
    except PermissionError:
        return {**report, "ok": False, "problem": "cannot read it: run cedana doctor as root"}
    mode = stat.S_IMODE(st.st_mode)
    report["mode"] = f"{mode:04o}"
    if mode & 0o077 or st.st_uid != 0:
        report.update(
            ok=False,
            problem=f"{path} must be owned by root with mode 0700 "
            "(checkpoints hold process memory): chown root {path}; chmod 0700 {path}",
        )
    else:
        report["ok"] = True
    usage = shutil.disk_usage(path)
    report["free_bytes"] = usage.free
    code, fstype = _run(["stat", "-f", "-c", "%T", path])
    if code == 0:
        report["filesystem"] = fstype
        if note := shared_filesystem_note(path, fstype):
            report["note"] = note
    return report


# `stat -f -c %T` names; a filesystem that other machines mount too.
SHARED_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "lustre", "ceph", "cifs", "smb2", "gpfs", "beegfs", "glusterfs", "fuseblk"}
)


def shared_filesystem_note(path: str, fstype: str) -> str:
    """What to say about a store on a filesystem other machines may mount ("": none)."""
    if fstype not in SHARED_FILESYSTEMS:
        return ""
    return (
        f"{path} is on {fstype}: keep store_path on this node's own disk (the store locks "
        "with flock(2), which not every shared filesystem makes coherent across nodes); "
        "to share checkpoints between nodes set registry to a directory on it instead"
    )


def run_doctor(args: argparse.Namespace) -> int:
    from ..config import load_node_config
    from ..gpu.doctor import readiness

    config = load_node_config(getattr(args, "config", None))
    store = getattr(args, "store", None) or config.store_path
    report: dict[str, Any] = {
        "criu": check_criu(),
        "runc": check_runc(),
        "store": check_store(store),
        "gpu": readiness(cli_path=config.cuda_checkpoint_path or None),
        "capabilities": check_capabilities(),
        "cgroups": check_cgroups(),
    }
    ready = all(report[k]["ok"] for k in ("criu", "runc", "store"))
    report["ready"] = ready
    if getattr(args, "json", False):
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        for name in ("criu", "runc", "store"):
            item = report[name]
            mark = "ok  " if item["ok"] else "FAIL"
            detail = item.get("problem") or item.get("version") or item.get("note") or ""
            sys.stdout.write(f"{mark}  {name:<6} {item.get('path', '')}  {detail}\n")
        for feature in (report["criu"].get("features") or {}).values():
            sys.stdout.write(f"      criu   {feature['meaning']}\n")
        for capability in report["capabilities"].values():
            sys.stdout.write(f"      caps   {capability['meaning']}\n")
        sys.stdout.write(f"      cgroup {report['cgroups']['meaning']}\n")
        gpu = report["gpu"]
        devices = gpu.get("devices") or []
        if devices:
            sys.stdout.write(f"gpu   driver {gpu.get('driverVersion')}, {len(devices)} device(s)\n")
        for key, value in gpu.items():
            if isinstance(value, dict) and value.get("available") is False:
                sys.stdout.write(f"gpu   {key}: {value.get('reason', 'not available')}\n")
        sys.stdout.write("ready\n" if ready else "not ready\n")
    return 0 if ready else 1

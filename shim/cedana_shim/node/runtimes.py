"""What runtime pods get on the node: the CRI's default, the ``cedana`` handler's
runc binary, and how that relates to the NVIDIA toolkit's ``nvidia`` runtime."""

from __future__ import annotations

import os

from . import containerd_config as cc
from . import registration as reg
from .hostfs import HostRoot
from .report import NodeError, Outcome, Report


def report(report: Report, plan: cc.Plan, runc: str | None, *, changed: bool) -> None:
    """Say which runtime pods get by default, and what GPU pods get, without guessing."""
    if plan.default_runtime:
        outcome: Outcome = "changed" if changed and plan.previous_default != reg.HANDLER else "ok"
        report.add(
            "default runtime",
            outcome,
            f"{reg.HANDLER} (was {plan.previous_default}): pods without runtimeClassName run "
            "under cedana-shim; containers without CEDANA_CHECKPOINT run as under runc",
        )
    else:
        report.add(
            "default runtime",
            "unchanged",
            f"{plan.previous_default} (--no-default-runtime): only pods with "
            f"runtimeClassName {reg.HANDLER} run under cedana-shim",
        )
    report.add(
        "runc binary",
        "ok",
        f"{runc} (--runc-binary; the {reg.HANDLER} handler's BinaryName)" if runc else "runc",
    )
    if plan.systemd_cgroup_lost:
        report.add(
            "cgroup driver",
            "warning",
            f"the node's runc uses the systemd cgroup driver but the {reg.HANDLER} handler's "
            f"cannot ({plan.systemd_cgroup_lost}): its containers run outside their pods' "
            "systemd slices; use containerd >= 1.7 and the default node config path",
        )
    elif plan.systemd_cgroup:
        report.add(
            "cgroup driver",
            "ok",
            f"systemd: the {reg.HANDLER} handler runs runc with SystemdCgroup = true, as the "
            "node's runc does",
        )
    nvidia = plan.nvidia_binary
    if nvidia is None:
        return
    nvidia_runs = nvidia or "runc"
    if runc and runc == nvidia:
        report.add(
            "nvidia runtime",
            "ok",
            f"the node's {reg.NVIDIA_HANDLER!r} runtime runs {nvidia_runs}, and so does "
            f"{reg.HANDLER!r}: GPU pods with runtimeClassName {reg.HANDLER} get the NVIDIA "
            "toolkit's device injection",
        )
    elif nvidia:
        report.add(
            "nvidia runtime",
            "warning",
            f"the node's {reg.NVIDIA_HANDLER!r} runtime runs {nvidia_runs} but {reg.HANDLER!r} "
            f"runs {runc or 'runc'}: GPU pods with runtimeClassName {reg.HANDLER} get no NVIDIA "
            f"device injection; install with --runc-binary {nvidia} for that",
        )
    else:
        report.add(
            "nvidia runtime", "ok", f"the node's {reg.NVIDIA_HANDLER!r} runtime names no BinaryName"
        )


def check_runc_binary(host: HostRoot, binary: str | None) -> None:
    """Refuse a ``--runc-binary`` the node cannot run (before anything is written)."""
    if binary is None:
        return
    if not binary or ("/" in binary and not os.path.isabs(binary)):
        raise NodeError(
            f"--runc-binary {binary!r}: give an absolute host path or a name on containerd's PATH"
        )
    if os.path.isabs(binary):
        real = host.path(binary)
        if not (os.path.isfile(real) and os.access(real, os.X_OK)):
            raise NodeError(
                f"--runc-binary {binary}: no executable file at {host.display(binary)}: "
                "install it (e.g. the NVIDIA container toolkit) or fix the path"
            )


def check_default_takeover(plan: cc.Plan, runc: str | None) -> None:
    """Refuse to take the default from the NVIDIA toolkit's runtime with a runc that
    would drop its device injection for every pod without runtimeClassName."""
    if not plan.default_runtime or plan.previous_default != reg.NVIDIA_HANDLER:
        return
    nvidia = plan.nvidia_binary or "runc"
    if (runc or "runc") == nvidia:
        return
    raise NodeError(
        f"containerd's default runtime is {reg.NVIDIA_HANDLER!r} (it runs {nvidia}): making "
        f"{reg.HANDLER!r} the default with {runc or 'runc'} would take the NVIDIA device "
        f"injection from every pod without runtimeClassName. Pass --runc-binary {nvidia} "
        "(chart: runtime.runcBinary), or --no-default-runtime (runtime.default: false)"
    )

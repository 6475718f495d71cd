"""Boot the VM tier's guest, run one command inside it, and exit with its status.

    python3 tests/vm/machine/vm.py [--timeout S] [--mem SIZE] [--smp N] -- CMD...

The guest is Debian 12's stock kernel under qemu (TCG: this host's /dev/kvm cannot
boot a stock kernel), systemd as PID 1 on cgroup v2 only, with this host's own / as
its root (read-only over 9p, a tmpfs overlay on top): the checkout, its venv,
containerd, runc, CRIU and Slurm are the host's. CMD runs as root in the current
directory once systemd has reached basic.target; its output is streamed here as it
comes (through a second 9p share, the exchange directory), and this program exits with
its exit status. A guest that does not finish within --timeout is killed: the run
fails with the tail of the console log and of the command's output, as does a guest
that powers off without reporting a status.

Standard library only: it runs before anything else is set up.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The guest's service: the command, then power off at once (nothing to save: the root
# is a tmpfs overlay, the exchange share is written through).
TARGET = """[Unit]
Description=cedana-shim VM tier
Requires=basic.target cedana-vm.service
After=basic.target
AllowIsolate=yes
"""
SERVICE = """[Unit]
Description=cedana-shim VM tier: the command
After=basic.target dbus.service
Wants=dbus.service
[Service]
Type=oneshot
ExecStart=/bin/sh /xchg/run.sh
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=infinity
"""
RUN_SH = """#!/bin/sh
# Written by vm.py for one run.
# A node has an address besides loopback: without one, getaddrinfo's AI_ADDRCONFIG
# (Slurm's daemons use it) resolves no name at all. A dummy link, nothing reaches out.
ip link add cedana-vm0 type dummy && ip addr add 192.0.2.10/24 dev cedana-vm0 &&
  ip link set cedana-vm0 up || echo "cedana-vm: no dummy network link"
echo "cedana-vm: command starts at $(cut -d' ' -f1 /proc/uptime)s of guest uptime"
(
  cd {cwd} || exit 125
  export HOME=/root LANG=C.UTF-8 {env}
  exec {command}
) </dev/null >>/xchg/out.log 2>&1
rc=$?
echo "cedana-vm: command exited $rc at $(cut -d' ' -f1 /proc/uptime)s of guest uptime"
echo $rc >/xchg/rc.tmp && mv /xchg/rc.tmp /xchg/rc
sync
systemctl poweroff --force --force
"""
# Passed into the guest when set here (the suite's knobs).
FORWARDED_ENV = ("CEDANA_TEST_", "CEDANA_VM_", "PYTEST_ADDOPTS")


def build() -> Path:
    """The kernel, its modules and the initramfs (built once, cached: build.sh)."""
    proc = subprocess.run(
        ["bash", str(HERE / "build.sh")], stdout=subprocess.PIPE, text=True, check=False
    )
    if proc.returncode != 0:
        sys.exit(f"vm: building the VM's kernel and initramfs failed ({proc.returncode})")
    return Path(proc.stdout.strip().splitlines()[-1])


def git_toplevel() -> Path | None:
    """The checkout the command runs in, if it runs in one."""
    found = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=False
    )
    return Path(found.stdout.strip()) if found.returncode == 0 else None


def prepare_exchange(xchg: Path, command: list[str]) -> None:
    units = xchg / "units"
    units.mkdir(parents=True)
    (units / "cedana-vm.target").write_text(TARGET)
    (units / "cedana-vm.service").write_text(SERVICE)
    env = " ".join(
        f"{k}={shlex.quote(v)}"
        for k, v in sorted(os.environ.items())
        if k.startswith(FORWARDED_ENV)
    )
    run = RUN_SH.format(cwd=shlex.quote(os.getcwd()), env=env, command=shlex.join(command))
    (xchg / "run.sh").write_text(run)
    (xchg / "out.log").touch()


def snapshot(checkout: Path, into: Path) -> None:
    """The checkout's files as they are now (tracked and untracked, not ignored, with
    the bytecode Python cached for them), for the guest: the host's working tree may be
    edited while the guest runs, and a file read half-written breaks the run. The venv
    and .git stay the host's (mounted in by the initramfs)."""
    ls_files = ["ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    listed = subprocess.run(
        ["git", "-C", str(checkout), *ls_files],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    names = [n.decode() for n in listed if n]
    for cache in checkout.rglob("__pycache__"):
        if ".venv" not in cache.relative_to(checkout).parts:
            names += [str(p.relative_to(checkout)) for p in cache.glob("*.pyc")]
    into.mkdir()
    for name in names:
        source = checkout / name
        if source.is_file() and not source.is_symlink():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        elif source.is_symlink():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(os.readlink(source))
    for mount_point in (".venv", ".git"):
        if (checkout / mount_point).is_dir():
            (into / mount_point).mkdir(exist_ok=True)


def qemu_argv(
    image: Path, xchg: Path, checkout: Path | None, args: argparse.Namespace
) -> list[str]:
    append = " ".join(
        [
            "console=ttyS0",
            "panic=-1",
            "loglevel=4",
            # cgroup v2 only, as on current distributions (and Kubernetes >= 1.35).
            "systemd.unified_cgroup_hierarchy=1",
            "systemd.unit=cedana-vm.target",
            # What the host enables and the tier does not need (apt's timers, NTP).
            "systemd.mask=timers.target",
            "systemd.mask=systemd-timesyncd.service",
            # Its kmod is the host's, absent.
            "systemd.mask=kmod-static-nodes.service",
            "systemd.show_status=0",
            f"cedana_vm.image={image}",
            *([f"cedana_vm.checkout={checkout}"] if checkout else []),
        ]
    )
    share = "security_model=passthrough"
    snapshot_share = (
        ["-virtfs", f"local,path={xchg / 'checkout'},mount_tag=checkout,{share},readonly=on"]
        if checkout
        else []
    )
    return [
        "qemu-system-x86_64",
        *("-accel", "tcg,thread=multi", "-cpu", "max", "-machine", "pc"),
        *("-m", args.mem, "-smp", str(args.smp)),
        *("-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"),
        *("-serial", f"file:{xchg / 'console.log'}"),
        *("-kernel", str(image / "vmlinuz"), "-initrd", str(image / "initramfs.cpio.gz")),
        *("-append", append),
        *("-virtfs", f"local,path=/,mount_tag=hostfs,{share},readonly=on,multidevs=remap"),
        *("-virtfs", f"local,path={xchg},mount_tag=xchg,{share}"),
        *snapshot_share,
    ]


class Tail:
    """Copies what a growing file gains to our stdout."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        if data:
            self.offset += len(data)
            sys.stdout.buffer.write(data)
            sys.stdout.flush()


def tail_of(path: Path, lines: int) -> str:
    try:
        text = path.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return "(none)"
    return "\n".join(text.replace("\r", "").splitlines()[-lines:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=1200, help="seconds (default 1200)")
    parser.add_argument("--mem", default="4G")
    parser.add_argument("--smp", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the exchange directory")
    parser.add_argument("command", nargs="+")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("vm: must run as root (the guest's root is this host's /, shared by qemu)")

    # A CI runner's SIGTERM (or a ^C) must take the guest down too: qemu has its own session.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    image = build()
    xchg = Path(tempfile.mkdtemp(prefix="cedana-vm-"))
    os.chmod(xchg, 0o755)
    prepare_exchange(xchg, args.command)
    checkout = git_toplevel()
    if checkout is not None:
        snapshot(checkout, xchg / "checkout")
    argv = qemu_argv(image, xchg, checkout, args)
    started = time.monotonic()
    out = Tail(xchg / "out.log")
    print(f"vm: booting {image.name} (exchange {xchg}, timeout {args.timeout:.0f}s)", flush=True)
    timed_out = False
    with open(xchg / "qemu.log", "wb") as qemu_log:
        qemu = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=qemu_log,
            start_new_session=True,
        )
        try:
            while qemu.poll() is None:
                out.pump()
                if time.monotonic() - started > args.timeout:
                    timed_out = True
                    break
                time.sleep(0.5)
        finally:
            if qemu.poll() is None:
                qemu.kill()
            qemu.wait()
    out.pump()
    elapsed = time.monotonic() - started
    rc_file = xchg / "rc"
    if timed_out or not rc_file.exists():
        why = (
            f"did not finish within {args.timeout:.0f}s"
            if timed_out
            else f"powered off without an exit status (qemu exit {qemu.returncode})"
        )
        print(
            f"vm: FAILED: the guest {why} after {elapsed:.0f}s\n"
            f"---- console (last 80 lines of {xchg / 'console.log'})\n"
            f"{tail_of(xchg / 'console.log', 80)}\n"
            f"---- qemu\n{tail_of(xchg / 'qemu.log', 20)}\n",
            file=sys.stderr,
            flush=True,
        )
        return 124 if timed_out else 125
    rc = int(rc_file.read_text().strip() or "125")
    print(f"vm: guest command exited {rc}; {elapsed:.0f}s from boot to power-off", flush=True)
    if not args.keep:
        shutil.rmtree(xchg, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())

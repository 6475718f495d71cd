"""What the kernel lets root do here, tried for real: tests compare the shim's view of
the capability bounding set with the behaviour it stands for."""

from __future__ import annotations

import resource
import subprocess
import sys

OTHER_UID = 1000


def prlimit_of_another_user_works() -> bool:
    """Whether this (root) process may read the resource limits of a process running as
    uid/gid 1000, as CRIU reads every process's limits: prlimit(2) needs CAP_SYS_RESOURCE
    for that. Needs root (to start the process as another user)."""
    child = subprocess.Popen(
        [
            sys.executable, "-c",
            f"import os, time; os.setresgid({OTHER_UID}, {OTHER_UID}, {OTHER_UID}); "
            f"os.setresuid({OTHER_UID}, {OTHER_UID}, {OTHER_UID}); "
            "print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        try:
            resource.prlimit(child.pid, resource.RLIMIT_CPU)
        except PermissionError:
            return False
        return True
    finally:
        child.kill()
        child.wait()

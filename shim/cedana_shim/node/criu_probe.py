"""Can this node's CRIU dump a TCP socket on the running kernel? Tried for real.

A version number does not say it: CRIU 4.1 fails every dump of a process holding an
inet socket on Linux >= 6.16 (the kernel refuses socket options it reads, "sockets:
Can't get 1:16 opt"), 4.2 does not, and what the next kernel changes nobody knows.
So the probe starts a process listening on 127.0.0.1, has CRIU dump it (leaving it
running, nothing restored) into a temporary dir, and reports CRIU's reason when that
fails. Takes ~0.1 s.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile

PROBE_TIMEOUT = 30.0
_LISTENER = (
    "import socket, sys, time\n"
    "s = socket.socket()\n"
    "s.bind(('127.0.0.1', 0))\n"
    "s.listen()\n"
    "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
    "time.sleep(600)\n"
)


def probe_inet_dump(criu: str) -> str | None:
    """None when ``criu`` dumps a process with a listening TCP socket here; otherwise
    what failed and what to do."""
    workdir = tempfile.mkdtemp(prefix="cedana-criu-probe-")
    listener = subprocess.Popen(
        [sys.executable, "-c", _LISTENER],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert listener.stdout is not None
        if listener.stdout.readline().strip() != b"ready":
            return "the CRIU socket probe could not start its listening process"
        argv = [criu, "dump", "-t", str(listener.pid), "-D", workdir, "-o", "dump.log"]
        argv += ["--shell-job", "--leave-running"]
        try:
            done = subprocess.run(argv, capture_output=True, timeout=PROBE_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            return f"{criu} dump of a process with a TCP socket did not end in {PROBE_TIMEOUT:g}s"
        except OSError as err:
            return f"cannot run {criu}: {err}"
        if done.returncode == 0:
            return None
        return _explain(criu, _error_lines(os.path.join(workdir, "dump.log")))
    finally:
        listener.kill()
        listener.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _error_lines(log: str) -> list[str]:
    try:
        with open(log, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    return [line for line in lines if "Error (" in line][-3:]


def _explain(criu: str, errors: list[str]) -> str:
    said = "; ".join(line.split("): ", 1)[-1] for line in errors) or "no reason in its log"
    kernel = platform.release()
    advice = "install a CRIU that supports this kernel"
    if any("sockets: Can't get" in line for line in errors):
        advice = "CRIU < 4.2 cannot read inet sockets on Linux >= 6.16: install CRIU >= 4.2"
    return (
        f"{criu} cannot checkpoint a process with a TCP socket on kernel {kernel} "
        f"({said}): {advice}; until then containers with sockets stop without a checkpoint"
    )

#!/usr/bin/env python3
"""The whole cedana story on one machine, with a real containerd, runc and CRIU.

1. a private containerd starts with the `cedana` runtime registered;
2. a counter container labelled CEDANA_CHECKPOINT=demo-counter runs;
3. it is stopped with SIGTERM, as kubelet stops a container: the shim
   checkpoints it into the node's store before it exits (status 143);
4. a NEW container with the same label starts: it resumes the count.

Run as root after `make setup` (which `make demo` does first). Everything
lives under a temporary directory that is removed at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.integration.harness.config import CEDANA, CONTAINERD_VERSIONS  # noqa: E402
from tests.integration.harness.containerd import make_containerd  # noqa: E402
from tests.integration.harness.images import build_test_images  # noqa: E402

NAMESPACE = "demo"
LABEL = "demo-counter"
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /count; echo count $i; sleep 0.5; done"


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="cedana-demo-"))
    images = build_test_images(workdir)
    node = make_containerd(CONTAINERD_VERSIONS[0], CEDANA, images, workdir, (NAMESPACE,))
    ctr = node.ctr(NAMESPACE)
    cedana = [str(REPO / ".venv/bin/cedana"), "checkpoints", "list", "--store", str(node.store)]
    try:
        say(f"containerd {node.version.full} with the cedana runtime at {node.socket}")
        ctr("run", "-d", "--runtime", CEDANA.runtime_type, "--env", f"CEDANA_CHECKPOINT={LABEL}",
            images.busybox, "counter-1", "sh", "-c", COUNTER)  # fmt: skip
        time.sleep(4)
        before = ctr("task", "exec", "--exec-id", "peek", "counter-1", "cat", "/count").stdout
        say(f"counter-1 is counting: {before.strip()}")

        say("ctr task kill -s SIGTERM counter-1   (the shim checkpoints it as it stops)")
        ctr("task", "kill", "-s", "SIGTERM", "counter-1")
        row = ctr.wait_status("counter-1", "STOPPED", timeout=60)
        print(f"counter-1 stopped: {row}")
        listing = subprocess.run(cedana, capture_output=True, text=True, check=True).stdout
        print(listing)
        entries = json.loads(
            subprocess.run([*cedana, "--json"], capture_output=True, text=True, check=True).stdout
        )
        assert entries and entries[0]["label"] == LABEL, "no checkpoint was committed"
        ctr.remove("counter-1")

        say(f"a new container, counter-2, with the same label {LABEL}")
        ctr("run", "-d", "--runtime", CEDANA.runtime_type, "--env", f"CEDANA_CHECKPOINT={LABEL}",
            images.busybox, "counter-2", "sh", "-c", COUNTER)  # fmt: skip
        time.sleep(2)
        after = ctr("task", "exec", "--exec-id", "peek", "counter-2", "cat", "/count").stdout
        say(f"counter-2 resumed the count: {before.strip()} -> {after.strip()}")
        if int(after) <= int(before):
            print("demo FAILED: the count did not continue", file=sys.stderr)
            return 1
        print("\nThe shim's own log lines (from containerd's log):")
        for line in node.log_since(0).splitlines():
            if '"logger":"cedana_shim.lifecycle.checkpointing"' in line:
                print("  " + line)
        return 0
    except Exception:
        print("\ncontainerd's log (with the shim's lines):\n" + node.log_tail(40), file=sys.stderr)
        raise
    finally:
        node.cleanup()
        subprocess.run(["rm", "-rf", "--one-file-system", str(workdir)], check=False)


if __name__ == "__main__":
    sys.exit(main())

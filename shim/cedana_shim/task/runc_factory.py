"""The runc driver for one container, as its runtime options and bundle ask.

The composition root hands the service a factory (tests hand it one that runs a
fake runc): the service never decides how runc is called.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from ..bundle_state import BundleState
from ..runtime.reaper import Reaper
from ..runtime.runc import Runc
from .options import RuntimeOptions

# (runtime options, containerd namespace, bundle) -> the driver for that container
RuncFactory = Callable[[RuntimeOptions, str, str], Runc]


def bundle_runc(reaper: Reaper, *, debug: bool = False) -> RuncFactory:
    """runc as the options say, recorded in the bundle for the ``delete`` command."""

    def make(options: RuntimeOptions, namespace: str, bundle: str) -> Runc:
        state = BundleState(
            options.binary_name, os.path.join(options.root, namespace), options.systemd_cgroup
        )
        state.save(bundle)
        return Runc(
            reaper=reaper,
            root=state.runc_root,
            log_path=os.path.join(bundle, "log.json"),
            binary=state.runc_binary,
            systemd_cgroup=state.systemd_cgroup,
            debug=debug,
        )

    return make

"""Operator hooks around checkpoint and restore, configured by hooks.d files in
the oci-hooks(5) format (see ``oci-hooks/README.md``).

The checkpoint layer holds a :class:`HookRunner`; the daemon builds a
:class:`ProcessHookRunner` with ``spawn=reaper_spawn(reaper)``, tests use
:class:`StubHookRunner`.
"""

from .base import (
    ANNOTATION_ID,
    ANNOTATION_OUTCOME,
    ANNOTATION_PATH,
    ANNOTATION_STAGE,
    HookFailed,
    HookReport,
    HookResult,
    HookRunner,
    HookState,
)
from .config import DEFAULT_DIRS, HookConfigError, Stage
from .runner import ProcessHookRunner
from .spawn import pidfd_spawn, reaper_spawn
from .stub import StubHookRunner

__all__ = [
    "ANNOTATION_ID",
    "ANNOTATION_OUTCOME",
    "ANNOTATION_PATH",
    "ANNOTATION_STAGE",
    "DEFAULT_DIRS",
    "HookConfigError",
    "HookFailed",
    "HookReport",
    "HookResult",
    "HookRunner",
    "HookState",
    "ProcessHookRunner",
    "Stage",
    "StubHookRunner",
    "pidfd_spawn",
    "reaper_spawn",
]

"""What the checkpoint layer sees of hooks: the :class:`HookRunner` protocol and
its values. ``task/`` and ``checkpoint/`` depend on this module only; the
process-running implementation is :mod:`.runner`, the test double :mod:`.stub`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .. import errors
from .config import Stage
from .match import annotations_of

ANNOTATION_ID = "cedana.ai/checkpoint.id"
ANNOTATION_PATH = "cedana.ai/checkpoint.path"  # the CRIU image directory
ANNOTATION_STAGE = "cedana.ai/checkpoint.stage"
ANNOTATION_OUTCOME = "cedana.ai/checkpoint.outcome"  # post stages only: "ok" / "failed"
OUTCOMES = ("", "ok", "failed")
# Used when config.json carries no ociVersion (it is required, so rarely).
DEFAULT_OCI_VERSION = "1.0.2"
MESSAGE_OUTPUT_CHARS = 4096  # of a hook's output quoted in an error message


@dataclass(frozen=True, slots=True)
class HookState:
    """The container and checkpoint a stage is about; becomes the hooks' stdin."""

    container_id: str
    bundle: str
    status: str  # OCI status as the stage sees it: "creating", "running", "stopped"...
    pid: int  # host pid of the container's init; 0 when there is none (prerestore)
    spec: Mapping[str, Any]  # config.json: its annotations, process.args and mounts
    checkpoint_id: str
    checkpoint_path: str
    outcome: str = ""  # "ok" / "failed" for post stages: did the operation succeed

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, not {self.outcome!r}")

    def oci_state(self, stage: Stage) -> dict[str, Any]:
        """The runtime-spec ``state`` JSON, with the checkpoint in its annotations.

        The cedana keys are written last, so a container cannot pose as another
        checkpoint through its own annotations.
        """
        annotations = annotations_of(self.spec)
        annotations[ANNOTATION_ID] = self.checkpoint_id
        annotations[ANNOTATION_PATH] = self.checkpoint_path
        annotations[ANNOTATION_STAGE] = stage.value
        if self.outcome:
            annotations[ANNOTATION_OUTCOME] = self.outcome
        else:
            annotations.pop(ANNOTATION_OUTCOME, None)
        version = self.spec.get("ociVersion")
        return {
            "ociVersion": version if isinstance(version, str) else DEFAULT_OCI_VERSION,
            "id": self.container_id,
            "status": self.status,
            "pid": self.pid,
            "bundle": self.bundle,
            "annotations": annotations,
        }


@dataclass(frozen=True, slots=True)
class HookResult:
    name: str  # hooks.d file name
    source: str  # hooks.d file path
    path: str  # the executable
    stage: Stage
    status: int | None  # exit status, 128+signal when killed; None if it never started
    timed_out: bool
    timeout: float
    error: str  # why it could not be started
    output: str  # the tail of what it wrote to stdout and stderr
    dropped: int  # bytes of output dropped ahead of that tail
    duration: float

    @property
    def ok(self) -> bool:
        return self.status == 0 and not self.timed_out

    def describe(self) -> str:
        if self.error:
            return f"could not run: {self.error}"
        if self.timed_out:
            return f"timed out after {self.timeout:g}s (process group killed)"
        return f"exit status {self.status}"


@dataclass(frozen=True, slots=True)
class HookReport:
    stage: Stage
    results: tuple[HookResult, ...] = ()
    config_errors: tuple[str, ...] = ()  # unusable hooks.d files (post stages carry on)

    @property
    def failures(self) -> tuple[HookResult, ...]:
        return tuple(r for r in self.results if not r.ok)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.config_errors


class HookFailed(errors.FailedPrecondition):
    """A precheckpoint/prerestore hook failed: the operation must not go ahead."""

    def __init__(self, result: HookResult, report: HookReport) -> None:
        self.result = result
        self.report = report
        message = f"{result.stage.value} hook {result.source} ({result.path}) failed: "
        message += result.describe()
        if result.output:
            tail = result.output[-MESSAGE_OUTPUT_CHARS:]
            cut = "..." if len(tail) < len(result.output) or result.dropped else ""
            message += f"; output: {cut}{tail}"
        super().__init__(message)


class HookRunner(Protocol):
    async def run(self, stage: Stage, state: HookState) -> HookReport:
        """Run ``stage``'s matching hooks in order.

        Raises :class:`HookFailed` (or ``HookConfigError``) for a pre stage that
        must abort the operation; post-stage failures are only reported.
        """
        ...

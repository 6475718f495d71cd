"""A :class:`~.base.HookRunner` for tests of the layers above: records every
call and fails the stages it is told to, without starting a process."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import HookFailed, HookReport, HookResult, HookState
from .config import PRE_STAGES, Stage


@dataclass
class StubHookRunner:
    calls: list[tuple[Stage, HookState]] = field(default_factory=list)
    failing: dict[Stage, str] = field(default_factory=dict)  # stage -> the hook's output

    @property
    def stages(self) -> list[Stage]:
        return [stage for stage, _ in self.calls]

    def fail(self, stage: Stage, output: str = "refused by stub hook") -> None:
        """Make ``stage`` fail: pre stages raise :class:`HookFailed`, post stages
        report the failure, as :class:`~.runner.ProcessHookRunner` does."""
        self.failing[stage] = output

    async def run(self, stage: Stage, state: HookState) -> HookReport:
        self.calls.append((stage, state))
        if stage not in self.failing:
            return HookReport(stage)
        result = HookResult(
            name="99-stub.json",
            source="/stub/hooks.d/99-stub.json",
            path="/stub/hook",
            stage=stage,
            status=1,
            timed_out=False,
            timeout=1.0,
            error="",
            output=self.failing[stage],
            dropped=0,
            duration=0.0,
        )
        report = HookReport(stage, (result,))
        if stage in PRE_STAGES:
            raise HookFailed(result, report)
        return report

"""What an install/uninstall did, step by step, for people (text) and programs (JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Outcome = Literal["changed", "unchanged", "skipped", "ok", "warning", "failed"]


class NodeError(Exception):
    """An expected failure: the message says which file or command and what to do."""


@dataclass
class Step:
    name: str
    outcome: Outcome
    detail: str


@dataclass
class Report:
    action: str
    steps: list[Step] = field(default_factory=list)
    restarted: bool = False
    ok: bool = True
    error: str | None = None

    def add(self, name: str, outcome: Outcome, detail: str) -> None:
        self.steps.append(Step(name, outcome, detail))

    @property
    def changed(self) -> bool:
        return any(s.outcome == "changed" for s in self.steps)

    def fail(self, message: str) -> None:
        self.ok = False
        self.error = message

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "ok": self.ok,
            "changed": self.changed,
            "restarted": self.restarted,
            "error": self.error,
            "steps": [s.__dict__ for s in self.steps],
        }

    def render(self) -> str:
        width = max((len(s.name) for s in self.steps), default=0)
        lines = [f"  {s.name:<{width}}  {s.outcome:<9}  {s.detail}" for s in self.steps]
        if self.ok:
            verb = "changed the node" if self.changed else "found nothing to change"
            tail = "; containerd restarted" if self.restarted else ""
            lines.append(f"{self.action}: done, {verb}{tail}")
        else:
            lines.append(f"{self.action}: FAILED: {self.error}")
        return "\n".join(lines)

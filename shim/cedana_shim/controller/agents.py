"""The node agents, found through their pods, and the calls the controller makes to
them (node/agent_api.py) with its own ServiceAccount token.

The token is read from its file at every call: a projected ServiceAccount token is
rotated by kubelet, and the agents check it by TokenReview.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

from ..untrusted_json import loads
from .kube import ClusterApi

VIEW_TIMEOUT: Final = 5.0
ACTION_TIMEOUT: Final = 660.0  # a checkpoint is given 600 s by the agent


class AgentError(Exception):
    """An agent could not be reached or refused; the message names the node."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AgentRef:
    node: str
    url: str


class Agents:
    def __init__(
        self,
        api: ClusterApi,
        token: Callable[[], str],
        *,
        namespace: str,
        selector: str,
        port: int,
    ) -> None:
        self._api = api
        self._token = token
        self._namespace = namespace
        self._selector = selector
        self._port = port

    def find(self) -> list[AgentRef]:
        """One agent per node: the running helper pods with an IP."""
        found: dict[str, AgentRef] = {}
        for pod in self._api.all_pods(self._namespace, self._selector):
            node = (pod.get("spec") or {}).get("nodeName") or ""
            ip = (pod.get("status") or {}).get("podIP") or ""
            if node and ip:
                host = f"[{ip}]" if ":" in ip else ip
                found[node] = AgentRef(node, f"http://{host}:{self._port}")
        return [found[n] for n in sorted(found)]

    def on(self, node: str) -> AgentRef:
        for agent in self.find():
            if agent.node == node:
                return agent
        raise AgentError(
            f"no cedana node agent runs on node {node} (no ready helper pod there): is the "
            "chart's DaemonSet scheduled on it?",
            404,
        )

    def call(
        self, agent: AgentRef, method: str, path: str, body: Any = None, timeout: float = 0
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            agent.url + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self._token()}",
                "Content-Type": "application/json",
            },
        )
        limit = timeout or (VIEW_TIMEOUT if method == "GET" else ACTION_TIMEOUT)
        try:
            with urllib.request.urlopen(request, timeout=limit) as answer:
                return loads(answer.read())
        except urllib.error.HTTPError as err:
            raise AgentError(
                f"node {agent.node}: {_reason(err)}", err.code if err.code < 500 else 502
            ) from None
        except (OSError, ValueError) as err:
            raise AgentError(
                f"node {agent.node}: agent at {agent.url} unreachable: {err}"
            ) from None

    def gather(self, path: str) -> tuple[list[Any], list[str]]:
        """GET ``path`` of every agent at once: the answers, and what failed."""
        agents = self.find()
        if not agents:
            return [], []
        answers: list[Any] = []
        failures: list[str] = []
        with ThreadPoolExecutor(min(16, len(agents))) as pool:
            for outcome in pool.map(lambda a: self._try(a, path), agents):
                if isinstance(outcome, AgentError):
                    failures.append(str(outcome))
                else:
                    answers.append(outcome)
        return answers, failures

    def _try(self, agent: AgentRef, path: str) -> Any:
        try:
            return self.call(agent, "GET", path)
        except AgentError as err:
            return err


def _reason(err: urllib.error.HTTPError) -> str:
    try:
        doc = loads(err.read())
        return str(doc.get("error") or doc) if isinstance(doc, dict) else str(doc)
    except (OSError, ValueError):
        return f"HTTP {err.code}"

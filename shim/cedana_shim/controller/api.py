"""The controller's HTTP surface: the UI's files and the JSON API it uses (and nothing
else uses: README "The dashboard" documents every route).

Every ``/api/`` call carries the user's own bearer token (``Authorization: Bearer``);
the UI keeps it in the tab's sessionStorage and sends it on each call. There is no
cookie, so another site cannot make the browser act for the user (no CSRF), and the
Content-Security-Policy allows only this server's own script and style.

GET  /api/v1/whoami                                 user, visible namespaces
GET  /api/v1/cluster                                nodes, workloads, checkpoints, failures
GET  /api/v1/namespaces/NS[?label=L]                a namespace's checkpoints, timeline
GET  /api/v1/checkpoints/ID                         one checkpoint, where, restores
POST /api/v1/checkpoints/ID/pin   {"pinned": bool}  pin or unpin (every node holding it)
POST /api/v1/checkpoints/ID/delete                  delete (every node holding it)
POST /api/v1/checkpoints/ID/copy                    a new pod restored from it
POST /api/v1/namespaces/NS/pods/POD/checkpoint  {"container"?}  checkpoint now
POST /api/v1/namespaces/NS/pods/POD/migrate  {"avoidNode"?}  202: an operation to poll
GET  /api/v1/operations/OP                          an operation's steps
GET  /api/v1/namespaces/NS/policies                 policies, what they cover, how applied
POST /api/v1/namespaces/NS/policies/NAME  {"selector", "interval", "retain", "pinLatest"}
POST /api/v1/namespaces/NS/policies/NAME/delete
"""

from __future__ import annotations

import json
import logging
import re
from importlib import resources
from typing import Any, Final

from ..node.http_server import Request, Response
from ..node.kube import Identity, KubeError, Rejected
from ..untrusted_json import loads
from .access import Denied
from .agents import AgentError
from .service import Dashboard, NotFoundError

_UI: Final = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/app.css": ("app.css", "text/css; charset=utf-8"),
}
_HEADERS: Final = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
_NAME = r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?)"
_ID = r"([0-9]{8}T[0-9]{6}Z-[0-9a-f]{8})"
_ROUTES: Final = [
    ("GET", re.compile(r"/api/v1/whoami"), "whoami"),
    ("GET", re.compile(r"/api/v1/cluster"), "cluster"),
    ("GET", re.compile(rf"/api/v1/namespaces/{_NAME}"), "namespace"),
    ("GET", re.compile(rf"/api/v1/checkpoints/{_ID}"), "checkpoint"),
    ("POST", re.compile(rf"/api/v1/checkpoints/{_ID}/pin"), "pin"),
    ("POST", re.compile(rf"/api/v1/checkpoints/{_ID}/delete"), "delete"),
    ("POST", re.compile(rf"/api/v1/checkpoints/{_ID}/copy"), "copy"),
    ("POST", re.compile(rf"/api/v1/namespaces/{_NAME}/pods/{_NAME}/checkpoint"), "checkpoint_now"),
    ("POST", re.compile(rf"/api/v1/namespaces/{_NAME}/pods/{_NAME}/migrate"), "migrate"),
    ("GET", re.compile(r"/api/v1/operations/(op-[0-9a-f]+)"), "operation"),
    ("GET", re.compile(rf"/api/v1/namespaces/{_NAME}/policies"), "policies"),
    ("POST", re.compile(rf"/api/v1/namespaces/{_NAME}/policies/{_NAME}"), "save_policy"),
    (
        "POST",
        re.compile(rf"/api/v1/namespaces/{_NAME}/policies/{_NAME}/delete"),
        "delete_policy",
    ),
]

log = logging.getLogger("cedana.controller")


def _json(status: int, doc: Any) -> Response:
    return Response(status, json.dumps(doc).encode(), headers=_HEADERS)


def _error(status: int, message: str) -> Response:
    return _json(status, {"error": message})


class ControllerApi:
    def __init__(self, dashboard: Dashboard) -> None:
        self.dashboard = dashboard

    def __call__(self, request: Request) -> Response:
        if request.method == "GET" and request.path in _UI:
            name, kind = _UI[request.path]
            body = resources.files(__package__).joinpath("ui", name).read_bytes()
            return Response(200, body, kind, _HEADERS)
        if request.path == "/healthz":
            return Response(200, b"ok\n", "text/plain; charset=utf-8")
        if not request.path.startswith("/api/"):
            return _error(404, f"no page {request.path}")
        token = request.bearer()
        if not token:
            return _error(401, "sign in: send your Kubernetes bearer token (Authorization)")
        try:
            who = self.dashboard.access.identity(token)
        except KubeError as err:
            return _error(503, f"cannot check the token with the API server: {err}")
        if who is None:
            return _error(401, "the API server does not accept this token; sign in again")
        for method, pattern, name in _ROUTES:
            match = pattern.fullmatch(request.path)
            if match and method == request.method:
                return self._run(name, who, request, match.groups())
            if match:
                return _error(405, f"{request.path} takes {method}")
        return _error(404, f"no API {request.method} {request.path}")

    def _run(self, name: str, who: Identity, request: Request, groups: tuple[Any, ...]) -> Response:
        d = self.dashboard
        # The first capture is the route's subject; a name's pattern has an inner group,
        # so a pod's name is the third.
        first = str(groups[0]) if groups else ""
        try:
            body = loads(request.body) if request.body else {}
            if not isinstance(body, dict):
                return _error(400, "the body must be a JSON object")
            if name == "whoami":
                return _json(200, d.whoami(who))
            if name == "cluster":
                return _json(200, d.cluster(who))
            if name == "namespace":
                return _json(200, d.namespace(who, first, request.query.get("label", "")))
            if name == "checkpoint":
                return _json(200, d.checkpoint(who, first))
            if name == "pin":
                return _json(200, d.pin(who, first, bool(body.get("pinned", True))))
            if name == "delete":
                return _json(200, d.delete(who, first))
            if name == "copy":
                return _json(201, d.copy(who, first))
            if name == "operation":
                return _json(200, d.operation(who, first))
            if name == "policies":
                return _json(200, d.policies(who, first))
            namespace, pod = first, str(groups[2])
            if name == "save_policy":
                return _json(200, d.save_policy(who, namespace, pod, body))
            if name == "delete_policy":
                return _json(200, d.delete_policy(who, namespace, pod))
            if name == "checkpoint_now":
                return _json(
                    200, d.checkpoint_now(who, namespace, pod, str(body.get("container") or ""))
                )
            if name == "migrate":
                avoid = bool(body.get("avoidNode", False))
                return _json(202, d.migrate(who, namespace, pod, avoid_node=avoid).to_json())
        except Denied as err:
            return _error(403, str(err))
        except NotFoundError as err:
            return _error(404, str(err))
        except AgentError as err:
            return _error(err.status, str(err))
        except Rejected as err:
            return _error(409, f"the API server refused: {err}")
        except KubeError as err:
            return _error(502, f"the API server failed: {err}")
        except ValueError as err:
            return _error(400, f"a malformed request: {err}")
        raise AssertionError(f"route {name} has no handler")

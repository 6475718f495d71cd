"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol, as a
person uses a page: keys typed and pressed, the mouse clicked where an element is
drawn, JavaScript dialogs (confirm) accepted, screenshots taken.

The protocol runs over `--remote-debugging-pipe` (fd 3: commands in, fd 4: answers
out, each message JSON ended by a NUL byte): no port, no websocket library.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import queue
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .util import wait_for

CHROMIUM = "/usr/bin/chromium"
WINDOW = (1400, 1000)
_KEYS = {
    "Enter": {"code": "Enter", "windowsVirtualKeyCode": 13, "text": "\r"},
    "Tab": {"code": "Tab", "windowsVirtualKeyCode": 9},
    "ArrowDown": {"code": "ArrowDown", "windowsVirtualKeyCode": 40},
}


class BrowserError(Exception):
    pass


class Browser:
    def __init__(self, profile: Path, log: Path) -> None:
        if not os.access(CHROMIUM, os.X_OK):
            raise BrowserError(f"{CHROMIUM} missing: apt-get install chromium (make setup)")
        cmd_r, self._cmd_w = os.pipe()
        self._res_r, res_w = os.pipe()

        def fds() -> None:
            # Above 10 first, so that placing them at 3 and 4 clobbers neither.
            high_r = fcntl.fcntl(cmd_r, fcntl.F_DUPFD, 10)
            high_w = fcntl.fcntl(res_w, fcntl.F_DUPFD, 10)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        argv = [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--remote-debugging-pipe", f"--user-data-dir={profile}",
            f"--window-size={WINDOW[0]},{WINDOW[1]}", "--hide-scrollbars",
            "--disable-extensions", "--disable-background-networking", "about:blank",
        ]  # fmt: skip
        self._log = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            argv, stdout=self._log, stderr=self._log, preexec_fn=fds, close_fds=False
        )
        os.close(cmd_r)
        os.close(res_w)
        self._ids = iter(range(1, 1 << 30))
        self._answers: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self.console: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        targets = self.send("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.send(
            "Target.attachToTarget", {"targetId": page["targetId"], "flatten": True}
        )["sessionId"]
        for domain in ("Page", "Runtime"):
            self.send(f"{domain}.enable", session=self.session)

    def close(self) -> None:
        with contextlib.suppress(BrowserError, OSError):
            self.send("Browser.close", timeout=5)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        with contextlib.suppress(OSError):
            os.close(self._cmd_w)
        self._log.close()

    # -- the protocol ------------------------------------------------------------------

    def _write(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode() + b"\0"
        with self._lock:
            os.write(self._cmd_w, data)

    def send(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        session: str | None = None,
        timeout: float = 30,
    ) -> dict[str, Any]:
        ident = next(self._ids)
        answer: queue.Queue[dict[str, Any]] = queue.Queue(1)
        self._answers[ident] = answer
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        self._write(message)
        try:
            reply = answer.get(timeout=timeout)
        except queue.Empty:
            raise BrowserError(f"{method}: no answer from chromium in {timeout}s") from None
        finally:
            self._answers.pop(ident, None)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result") or {}
        return result

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._res_r, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                self._dispatch(json.loads(raw))

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "id" in message:
            waiter = self._answers.get(message["id"])
            if waiter is not None:
                waiter.put(message)
            return
        method = message.get("method")
        if method == "Page.javascriptDialogOpening":
            # A person reads the question and says yes; answered from this thread
            # without waiting (the page is blocked until then).
            self._write(
                {
                    "id": next(self._ids),
                    "method": "Page.handleJavaScriptDialog",
                    "params": {"accept": True},
                    "sessionId": message.get("sessionId"),
                }
            )
        elif method == "Runtime.consoleAPICalled":
            args = message["params"].get("args") or []
            self.console.append(" ".join(str(a.get("value", a.get("description"))) for a in args))
        elif method == "Runtime.exceptionThrown":
            details = message["params"]["exceptionDetails"]
            self.console.append(f"exception: {details.get('exception', details)}")

    # -- a person's actions ------------------------------------------------------------

    def open(self, url: str) -> None:
        self.send("Page.navigate", {"url": url}, session=self.session)
        self.wait("document.readyState === 'complete'", what=f"{url} to load")

    def reload(self) -> None:
        """What the browser's reload does: the page from scratch (sessionStorage stays)."""
        self.send("Page.reload", {}, session=self.session)
        self.wait("document.readyState === 'complete'", what="the page to load again")

    def eval(self, expression: str) -> Any:
        result = self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            session=self.session,
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, *, what: str, timeout: float = 60) -> Any:
        def probe() -> Any:
            return self.eval(expression)

        try:
            return wait_for(probe, timeout=timeout, what=what)
        except Exception as err:
            status = self.eval("document.querySelector('#status')?.textContent || ''")
            raise BrowserError(
                f"{err}; the page's status line: {status!r}; console: {self.console[-5:]}"
            ) from None

    def press(self, key: str) -> None:
        spec = _KEYS[key]
        for kind in ("keyDown", "keyUp"):
            params = {"type": kind, "key": key, **spec}
            if kind == "keyUp":
                params.pop("text", None)
            self.send("Input.dispatchKeyEvent", params, session=self.session)

    def type(self, text: str) -> None:
        self.send("Input.insertText", {"text": text}, session=self.session)

    def focused(self) -> str:
        """The focused element, as "tag#id" or "tag[aria-label]"."""
        return str(
            self.eval(
                "(() => { const e = document.activeElement; return e.tagName.toLowerCase() + "
                "(e.id ? '#' + e.id : '[' + (e.getAttribute('aria-label') || e.textContent) "
                "+ ']'); })()"
            )
        )

    def click(self, selector: str) -> None:
        """A mouse click in the middle of the element, scrolled into view first."""
        box = self.wait(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) "
            "return null; e.scrollIntoView({block: 'center'}); const r = "
            "e.getBoundingClientRect(); return {x: r.x + r.width / 2, y: r.y + r.height / 2}; })()",
            what=f"{selector} on the page",
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.send(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": box["x"], "y": box["y"], "button": "left", "clickCount": 1},
                session=self.session,
            )

    def screenshot(self, path: Path) -> Path:
        data = self.send(
            "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
            session=self.session,
        )["data"]  # fmt: skip
        path.write_bytes(base64.b64decode(data))
        return path

    def text(self) -> str:
        return str(self.eval("document.body.innerText"))


@contextlib.contextmanager
def browser(workdir: Path) -> Iterator[Browser]:
    profile = workdir / "chromium-profile"
    profile.mkdir()
    b = Browser(profile, workdir / "chromium.log")
    try:
        yield b
    finally:
        b.close()
        shutil.rmtree(profile, ignore_errors=True)

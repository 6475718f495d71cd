"""hooks.d files: the oci-hooks(5) 1.0.0 schema, with checkpoint stages added.

A file looks like podman's and CRI-O's::

    {"version": "1.0.0",
     "hook": {"path": "/abs/exe", "args": ["exe", "x"], "env": ["K=V"], "timeout": 10},
     "when": {"always": true, "annotations": {"key-re": "value-re"},
              "commands": ["re"], "hasBindMounts": true},
     "stages": ["precheckpoint", "postrestore"]}

:func:`parse` is pure and checks everything up front, so the runner never
meets a malformed hook. It is stricter than containers/common, which ignores
unknown keys: a misspelt key there (podman itself once shipped ``annotation``
for ``annotations``) silently turns a condition off, and here a precheckpoint
hook that never matches is a checkpoint taken without the operator's guard.

:func:`load` reads the directories in order; a file in a later directory masks
the file of the same name in an earlier one (so ``/etc`` overrides the packaged
``/usr/share`` defaults, as in podman), and hooks are ordered by file name.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NoReturn

from .. import errors, untrusted_json

VERSION = "1.0.0"
# Later directories win, as in containers/common's hooks.New (increasing preference).
DEFAULT_DIRS = ("/usr/share/cedana/hooks.d", "/etc/cedana/hooks.d")
MAX_FILE_BYTES = 1 << 20
MAX_TIMEOUT = 24 * 3600  # larger values are typos, and overflow asyncio's timers


class Stage(StrEnum):
    # OCI runtime-spec stages: runc runs these from config.json; accepted here so
    # one file can serve both worlds, never run by the shim's runner.
    PRESTART = "prestart"
    CREATE_RUNTIME = "createRuntime"
    CREATE_CONTAINER = "createContainer"
    START_CONTAINER = "startContainer"
    POSTSTART = "poststart"
    POSTSTOP = "poststop"
    # Checkpoint stages, run by the shim.
    PRECHECKPOINT = "precheckpoint"
    POSTCHECKPOINT = "postcheckpoint"
    PRERESTORE = "prerestore"
    POSTRESTORE = "postrestore"


CHECKPOINT_STAGES = frozenset(
    {Stage.PRECHECKPOINT, Stage.POSTCHECKPOINT, Stage.PRERESTORE, Stage.POSTRESTORE}
)
# A failure in these aborts the operation; in the others it is only reported.
PRE_STAGES = frozenset({Stage.PRECHECKPOINT, Stage.PRERESTORE})


class HookConfigError(errors.FailedPrecondition):
    """A hooks.d file that cannot be used; names the file and the field."""

    def __init__(self, source: str, field: str, reason: str) -> None:
        self.source = source
        self.field = field
        self.reason = reason
        where = f"{source}: {field}" if field else source
        super().__init__(f"hooks file {where}: {reason}")


@dataclass(frozen=True, slots=True)
class Hook:
    """The runtime-spec hook entry."""

    path: str
    args: tuple[str, ...]  # execv's argv, argv[0] included; empty means (path,)
    env: tuple[str, ...] | None  # None: inherit the shim's environment (as runc does)
    timeout: int | None  # seconds

    @property
    def argv(self) -> tuple[str, ...]:
        return self.args or (self.path,)


@dataclass(frozen=True, slots=True)
class When:
    always: bool | None
    annotations: tuple[tuple[re.Pattern[str], re.Pattern[str]], ...]
    commands: tuple[re.Pattern[str], ...]
    has_bind_mounts: bool | None


@dataclass(frozen=True, slots=True)
class HookConfig:
    name: str  # the file name: sort key, and what masks across directories
    source: str  # the file's path
    hook: Hook
    when: When
    stages: frozenset[Stage]


@dataclass(frozen=True, slots=True)
class Catalog:
    hooks: tuple[HookConfig, ...]  # in run order
    errors: tuple[HookConfigError, ...]  # files that could not be used


def sort_key(name: str) -> tuple[str, str]:
    # oci-hooks(5): lower-cased names by code point; the name itself breaks ties.
    return (name.lower(), name)


def load(dirs: Sequence[str] = DEFAULT_DIRS) -> Catalog:
    """Every ``*.json`` of ``dirs``, later directories masking earlier ones.

    A missing directory is not an error (most nodes have none). A file that
    cannot be read or parsed is reported in ``errors``, never skipped silently.
    """
    chosen: dict[str, str] = {}
    problems: list[HookConfigError] = []
    for directory in dirs:
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            continue
        except OSError as err:
            problems.append(HookConfigError(directory, "", f"cannot list: {err.strerror}"))
            continue
        for name in names:
            if name.endswith(".json"):
                chosen[name] = os.path.join(directory, name)
    hooks: list[HookConfig] = []
    for name in sorted(chosen, key=sort_key):
        try:
            hooks.append(parse(_read(chosen[name]), source=chosen[name]))
        except HookConfigError as err:
            problems.append(err)
    return Catalog(tuple(hooks), tuple(problems))


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise HookConfigError(path, "", "not a regular file")
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise HookConfigError(path, "", f"cannot read: {err.strerror}") from err
    if len(data) > MAX_FILE_BYTES:
        raise HookConfigError(path, "", f"larger than {MAX_FILE_BYTES} bytes")
    return data


def parse(data: bytes | str, *, source: str) -> HookConfig:
    """Parse and validate one file's content; raises only :class:`HookConfigError`."""
    p = _Parser(source)
    doc = p.decode(data)
    top = p.object(doc, "")
    p.only(top, "", {"version", "hook", "when", "stages"})
    if "version" not in top:
        p.fail("version", f'missing (this reader knows "{VERSION}")')
    if top["version"] != VERSION:
        p.fail("version", f'{_show(top["version"])} is not supported (only "{VERSION}")')
    return HookConfig(
        name=os.path.basename(source),
        source=source,
        hook=p.hook(p.required(top, "hook")),
        when=p.when(p.required(top, "when")),
        stages=p.stages(p.required(top, "stages")),
    )


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, field: str, reason: str) -> NoReturn:
        raise HookConfigError(self.source, field, reason)

    def decode(self, data: bytes | str) -> Any:
        try:
            text = data.decode("utf-8") if isinstance(data, bytes) else data
            return untrusted_json.loads(
                text, object_pairs_hook=self._no_duplicates, parse_constant=self._no_constant
            )
        except HookConfigError:
            raise
        except UnicodeDecodeError as err:
            self.fail("", f"not UTF-8 (byte {err.start})")
        except json.JSONDecodeError as err:
            self.fail("", f"not JSON: {err.msg} at line {err.lineno} column {err.colno}")
        except ValueError as err:  # huge integers, absurd nesting
            self.fail("", f"not usable JSON: {err}")

    def _no_duplicates(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                # Which copy a reader keeps differs between JSON libraries.
                self.fail(key, "appears twice in one object")
            out[key] = value
        return out

    def _no_constant(self, name: str) -> NoReturn:
        self.fail("", f"{name} is not JSON")

    def object(self, value: Any, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(field, f"must be an object, not {_kind(value)}")
        return value

    def required(self, obj: Mapping[str, Any], key: str) -> Any:
        if key not in obj:
            self.fail(key, "missing")
        return obj[key]

    def only(self, obj: Mapping[str, Any], field: str, known: Iterable[str]) -> None:
        for key in obj:
            if key not in known:
                where = f"{field}.{key}" if field else key
                self.fail(where, f"unknown key (expected one of {', '.join(sorted(known))})")

    def string(self, value: Any, field: str) -> str:
        if not isinstance(value, str):
            self.fail(field, f"must be a string, not {_kind(value)}")
        if "\0" in value:
            self.fail(field, "contains a NUL byte")
        return value

    def strings(self, value: Any, field: str) -> tuple[str, ...]:
        if not isinstance(value, list):
            self.fail(field, f"must be an array of strings, not {_kind(value)}")
        return tuple(self.string(item, f"{field}[{i}]") for i, item in enumerate(value))

    def boolean(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            self.fail(field, f"must be true or false, not {_kind(value)}")
        return value

    def regex(self, value: Any, field: str) -> re.Pattern[str]:
        text = self.string(value, field)
        try:
            return re.compile(text)
        except (re.error, OverflowError, RecursionError, ValueError) as err:
            self.fail(field, f"bad regular expression {_show(text)}: {err}")

    def hook(self, value: Any) -> Hook:
        obj = self.object(value, "hook")
        self.only(obj, "hook", {"path", "args", "env", "timeout"})
        if "path" not in obj:
            self.fail("hook.path", "missing")
        path = self.string(obj["path"], "hook.path")
        if not os.path.isabs(path):
            self.fail("hook.path", f"must be an absolute path, not {_show(path)}")
        args = self.strings(obj["args"], "hook.args") if "args" in obj else ()
        env = self.strings(obj["env"], "hook.env") if "env" in obj else None
        for i, entry in enumerate(env or ()):
            key, eq, _ = entry.partition("=")
            if not key or not eq:
                self.fail(f"hook.env[{i}]", f"must be KEY=VALUE, not {_show(entry)}")
        timeout = None
        if "timeout" in obj:
            timeout = obj["timeout"]
            if not isinstance(timeout, int) or isinstance(timeout, bool):
                self.fail(
                    "hook.timeout", f"must be a whole number of seconds, not {_kind(timeout)}"
                )
            if not 0 < timeout <= MAX_TIMEOUT:
                self.fail("hook.timeout", f"must be between 1 and {MAX_TIMEOUT} seconds")
        return Hook(path=path, args=args, env=env, timeout=timeout)

    def when(self, value: Any) -> When:
        obj = self.object(value, "when")
        known = {"always", "annotations", "commands", "hasBindMounts"}
        self.only(obj, "when", known)
        if not obj:
            # containers/common would load it and never match it.
            self.fail("when", f"set at least one of {', '.join(sorted(known))}")
        annotations: list[tuple[re.Pattern[str], re.Pattern[str]]] = []
        if "annotations" in obj:
            pairs = self.object(obj["annotations"], "when.annotations")
            if not pairs:
                self.fail("when.annotations", "is empty: it would never match")
            for key, val in pairs.items():
                field = f"when.annotations[{_show(key)}]"
                annotations.append((self.regex(key, field), self.regex(val, field)))
        commands: tuple[re.Pattern[str], ...] = ()
        if "commands" in obj:
            texts = self.strings(obj["commands"], "when.commands")
            if not texts:
                self.fail("when.commands", "is empty: it would never match")
            commands = tuple(self.regex(t, f"when.commands[{i}]") for i, t in enumerate(texts))
        return When(
            always=self.boolean(obj["always"], "when.always") if "always" in obj else None,
            annotations=tuple(annotations),
            commands=commands,
            has_bind_mounts=(
                self.boolean(obj["hasBindMounts"], "when.hasBindMounts")
                if "hasBindMounts" in obj
                else None
            ),
        )

    def stages(self, value: Any) -> frozenset[Stage]:
        names = self.strings(value, "stages")
        if not names:
            self.fail("stages", "is empty: the hook would never run")
        out: set[Stage] = set()
        for i, name in enumerate(names):
            try:
                out.add(Stage(name))
            except ValueError:
                known = ", ".join(s.value for s in Stage)
                self.fail(f"stages[{i}]", f"unknown stage {_show(name)} (known: {known})")
        return frozenset(out)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True) if isinstance(value, str) else _kind(value)
    return text if len(text) <= 80 else text[:77] + "..."

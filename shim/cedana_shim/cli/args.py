"""The shim's command line, parsed the way Go's ``flag`` package does.

containerd runs ``containerd-shim-cedana-v2 -namespace NS -address A
-publish-binary P -id ID [-bundle B] [-debug] start|delete`` and, for the daemon,
the same flags with no action. Flags come before the action; ``-name value``,
``--name value`` and ``-name=value`` are all accepted; parsing stops at the first
positional argument.
"""

from __future__ import annotations

TYPE_CHECKING = False  # collections.abc costs ~1.5 ms: start/delete are hot
if TYPE_CHECKING:
    from collections.abc import Sequence

STRING_FLAGS = {
    "namespace",
    "address",
    "publish-binary",
    "id",
    "bundle",
    "socket",
    "debug-socket",
}
BOOL_FLAGS = {"debug", "v", "version", "info"}
TRUE_WORDS = {"1", "t", "true", "T", "TRUE", "True"}
FALSE_WORDS = {"0", "f", "false", "F", "FALSE", "False"}


class UsageError(ValueError):
    pass


class ShimArgs:
    """The parsed command line. A plain class: ``dataclasses`` would cost the
    short ``start``/``delete`` commands several milliseconds of import."""

    __slots__ = (
        "action",
        "address",
        "bundle",
        "debug",
        "id",
        "info",
        "namespace",
        "publish_binary",
        "rest",
        "socket",
        "version",
    )  # fmt: skip

    def __init__(
        self,
        *,
        namespace: str = "",
        address: str = "",
        publish_binary: str = "",
        id: str = "",
        bundle: str = "",
        socket: str = "",
        debug: bool = False,
        version: bool = False,
        info: bool = False,
        action: str = "",  # "start", "delete" or "" for the daemon
        rest: tuple[str, ...] = (),
    ) -> None:
        self.namespace = namespace
        self.address = address
        self.publish_binary = publish_binary
        self.id = id
        self.bundle = bundle
        self.socket = socket
        self.debug = debug
        self.version = version
        self.info = info
        self.action = action
        self.rest = rest

    def _fields(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShimArgs) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        pairs = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"ShimArgs({pairs})"


def parse_args(argv: Sequence[str]) -> ShimArgs:
    values: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        name, eq, inline = arg.lstrip("-").partition("=")
        if name in BOOL_FLAGS:
            if not eq:
                values[name] = True
            elif inline in TRUE_WORDS or inline in FALSE_WORDS:
                values[name] = inline in TRUE_WORDS
            else:
                raise UsageError(f"invalid boolean value {inline!r} for flag -{name}")
        elif name in STRING_FLAGS:
            if eq:
                values[name] = inline
            elif i + 1 < len(argv):
                i += 1
                values[name] = argv[i]
            else:
                raise UsageError(f"flag needs an argument: -{name}")
        else:
            raise UsageError(f"flag provided but not defined: -{name}")
        i += 1
    positional = tuple(argv[i:])

    def text(name: str) -> str:
        value = values.get(name, "")
        return value if isinstance(value, str) else ""

    return ShimArgs(
        namespace=text("namespace"),
        address=text("address"),
        publish_binary=text("publish-binary"),
        id=text("id"),
        bundle=text("bundle"),
        socket=text("socket"),
        debug=values.get("debug") is True,
        version=values.get("v") is True or values.get("version") is True,
        info=values.get("info") is True,
        action=positional[0] if positional else "",
        rest=positional[1:],
    )

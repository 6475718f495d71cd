"""Runtime options: what containerd tells the shim about how to run runc.

They arrive as a ``google.protobuf.Any`` in ``CreateTaskRequest.options`` (and on
``start``'s stdin): ``containerd.runc.v1.Options`` from ctr/clients that know runc
and from the CRI for a runc-type runtime (how ``cedana node install`` registers the
handler from containerd 1.7: no ConfigPath, the default node config applies),
``runtimeoptions.v1.Options`` from the CRI for any other runtime type (``ConfigPath``,
and from containerd 1.7 the whole ``options`` TOML table in ``config_body``; the
handler's form on containerd 1.6), or nothing. containerd >= 2.3 wraps the start options in a
``BootstrapParams``. Everything is turned into one frozen
:class:`RuntimeOptions`; unknown types are refused, not ignored.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from typing import Any as AnyValue

from google.protobuf.any_pb2 import Any
from google.protobuf.message import DecodeError

from ..api.containerd import bootstrap_pb2, runtimeoptions_pb2
from ..api.containerd.runc import options_pb2
from ..errors import InvalidArgument

RUNC_OPTIONS = "containerd.runc.v1.Options"
CRI_OPTIONS = "runtimeoptions.v1.Options"
DEFAULT_RUNC_ROOT = "/run/containerd/runc"


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    binary_name: str = "runc"
    root: str = DEFAULT_RUNC_ROOT
    systemd_cgroup: bool = False
    no_pivot_root: bool = False
    no_new_keyring: bool = False
    io_uid: int = 0
    io_gid: int = 0
    criu_image_path: str = ""
    criu_work_path: str = ""
    shim_cgroup: str = ""
    config_path: str = ""  # node config file named by the CRI runtime's ConfigPath


# TOML keys of a CRI runtime's `options` table (Go field names) -> our fields.
_TOML_KEYS = {
    "binaryname": "binary_name",
    "root": "root",
    "systemdcgroup": "systemd_cgroup",
    "nopivotroot": "no_pivot_root",
    "nonewkeyring": "no_new_keyring",
    "iouid": "io_uid",
    "iogid": "io_gid",
    "criuimagepath": "criu_image_path",
    "criuworkpath": "criu_work_path",
    "shimcgroup": "shim_cgroup",
    "configpath": "config_path",
}
_DEFAULTS = RuntimeOptions()


def type_name(type_url: str) -> str:
    """``type.googleapis.com/x.Y`` and bare ``x.Y`` name the same type."""
    return type_url.rsplit("/", 1)[-1]


def parse_runtime_options(options: Any | None) -> RuntimeOptions:
    if options is None or not options.type_url:
        return RuntimeOptions()
    name = type_name(options.type_url)
    try:
        if name == RUNC_OPTIONS:
            runc = options_pb2.Options.FromString(options.value)
            return RuntimeOptions(
                binary_name=runc.binary_name or "runc",
                root=runc.root or DEFAULT_RUNC_ROOT,
                systemd_cgroup=runc.systemd_cgroup,
                no_pivot_root=runc.no_pivot_root,
                no_new_keyring=runc.no_new_keyring,
                io_uid=runc.io_uid,
                io_gid=runc.io_gid,
                criu_image_path=runc.criu_image_path,
                criu_work_path=runc.criu_work_path,
                shim_cgroup=runc.shim_cgroup,
            )
        if name == CRI_OPTIONS:
            cri = runtimeoptions_pb2.Options.FromString(options.value)
            parsed = _from_toml(cri.config_body) if cri.config_body else RuntimeOptions()
            return replace(parsed, config_path=cri.config_path or parsed.config_path)
    except DecodeError as err:
        raise InvalidArgument(f"runtime options of type {name} do not decode: {err}") from err
    raise InvalidArgument(
        f"unsupported runtime options type {name!r}: expected {RUNC_OPTIONS} or {CRI_OPTIONS}"
    )


def _from_toml(body: bytes) -> RuntimeOptions:
    try:
        table = tomllib.loads(body.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise InvalidArgument(f"runtime options config_body is not TOML: {err}") from err
    values: dict[str, AnyValue] = {}
    for key, value in table.items():
        field = _TOML_KEYS.get(key.lower().replace("_", ""))
        if field is None:
            continue  # keys for other consumers (our node config) pass through
        expected = type(getattr(_DEFAULTS, field))
        if type(value) is not expected:
            raise InvalidArgument(
                f"runtime option {key} = {value!r}: expected a {expected.__name__}"
            )
        values[field] = value
    return RuntimeOptions(**values)


def decode_start_stdin(data: bytes, instance_id: str) -> Any | None:
    """The options Any from ``start``'s stdin, in either form containerd sends.

    Both ``Any`` (1: type_url, 2: value) and ``BootstrapParams`` (1: instance_id,
    2: namespace, ...) parse as each other, so decide on content: any field
    from 3 up, or field 1 equal to our ``-id``, means BootstrapParams.
    """
    if not data:
        return None
    try:
        params = bootstrap_pb2.BootstrapParams.FromString(data)
    except DecodeError:
        params = None
    if params is not None and (
        params.instance_id == instance_id
        or params.log_level
        or params.containerd_version
        or params.containerd_ttrpc_address
        or params.containerd_grpc_address
        or params.containerd_binary
        or params.extensions
        or params.HasField("socket_dir")
    ):
        for ext in params.extensions:
            if type_name(ext.value.type_url) in (RUNC_OPTIONS, CRI_OPTIONS):
                return ext.value
        return None
    try:
        return Any.FromString(data)
    except DecodeError as err:
        raise InvalidArgument(f"start options on stdin do not decode: {err}") from err

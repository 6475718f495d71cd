"""Runtime options in every form containerd sends them."""

import pytest
from cedana_shim.api.containerd import bootstrap_pb2, runtimeoptions_pb2
from cedana_shim.api.containerd.runc import options_pb2
from cedana_shim.errors import InvalidArgument
from cedana_shim.task.options import (
    RuntimeOptions,
    decode_start_stdin,
    parse_runtime_options,
)
from google.protobuf.any_pb2 import Any


def pack(message: object, prefix: str = "") -> Any:
    return Any(
        type_url=prefix + message.DESCRIPTOR.full_name,  # type: ignore[attr-defined]
        value=message.SerializeToString(),  # type: ignore[attr-defined]
    )


def test_none_and_empty_give_defaults() -> None:
    assert parse_runtime_options(None) == RuntimeOptions()
    assert parse_runtime_options(Any()) == RuntimeOptions()


@pytest.mark.parametrize("prefix", ["", "type.googleapis.com/"])
def test_runc_options(prefix: str) -> None:
    opts = options_pb2.Options(
        binary_name="/usr/local/bin/runc", root="/r", systemd_cgroup=True, io_uid=5, io_gid=6
    )
    parsed = parse_runtime_options(pack(opts, prefix))
    assert parsed.binary_name == "/usr/local/bin/runc"
    assert (parsed.root, parsed.systemd_cgroup, parsed.io_uid, parsed.io_gid) == ("/r", True, 5, 6)


def test_cri_options_config_path_and_toml_body() -> None:
    body = b'BinaryName = "/opt/runc"\nSystemdCgroup = true\nConfigPath = "/x"\nOther = 1\n'
    opts = runtimeoptions_pb2.Options(config_path="/etc/cedana/shim.toml", config_body=body)
    parsed = parse_runtime_options(pack(opts))
    assert parsed.binary_name == "/opt/runc"
    assert parsed.systemd_cgroup is True
    assert parsed.config_path == "/etc/cedana/shim.toml"  # the explicit field wins


def test_cri_options_with_wrongly_typed_value_are_refused() -> None:
    opts = runtimeoptions_pb2.Options(config_body=b'SystemdCgroup = "yes"\n')
    with pytest.raises(InvalidArgument, match="SystemdCgroup"):
        parse_runtime_options(pack(opts))


def test_unknown_type_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="unsupported runtime options type"):
        parse_runtime_options(Any(type_url="x.Y", value=b""))


def test_start_stdin_any_form() -> None:
    opts = runtimeoptions_pb2.Options(config_path="/p")
    any_ = pack(opts)
    assert decode_start_stdin(any_.SerializeToString(), "ctr-1") == any_
    assert decode_start_stdin(b"", "ctr-1") is None


def test_start_stdin_bootstrap_form() -> None:
    inner = pack(options_pb2.Options(root="/r"))
    params = bootstrap_pb2.BootstrapParams(
        instance_id="ctr-1", namespace="default", containerd_version="2.3.0"
    )
    params.extensions.add().value.CopyFrom(inner)
    assert decode_start_stdin(params.SerializeToString(), "ctr-1") == inner

"""docker config.json credentials: parsing (hypothesis) and the auth file's checks."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
from cedana_shim.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from cedana_shim.registry.credentials import Credentials, load_credentials, parse_auth_config
from hypothesis import given
from hypothesis import strategies as st

HOST = "registry.example.com:5000"
users = st.text(min_size=1, max_size=20).filter(lambda u: ":" not in u)
passwords = st.text(max_size=40)
spellings = st.sampled_from([HOST, f"https://{HOST}", f"http://{HOST}/v1/", HOST.upper()])


def _config(entries: dict[str, dict[str, str]]) -> bytes:
    return json.dumps({"auths": entries, "credsStore": "desktop"}).encode()


@given(users, passwords, spellings)
def test_auth_field_round_trip(user: str, password: str, key: str) -> None:
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    data = _config({"other.example.com": {"auth": "eDp5"}, key: {"auth": auth}})
    creds = parse_auth_config(data, HOST, source="cfg")
    assert creds == Credentials(username=user, password=password)


@given(users, passwords, st.text(max_size=40))
def test_username_password_and_identity_token(user: str, password: str, token: str) -> None:
    entry = {"username": user, "password": password, "identitytoken": token}
    creds = parse_auth_config(_config({HOST: entry}), HOST, source="cfg")
    assert creds == Credentials(username=user, password=password, identity_token=token)


def test_no_entry_for_the_host_is_none() -> None:
    assert parse_auth_config(_config({"other:5000": {"auth": "eDp5"}}), HOST, source="c") is None
    assert parse_auth_config(b"{}", HOST, source="c") is None
    assert parse_auth_config(_config({HOST: {"email": "x@y"}}), HOST, source="c") is None


@pytest.mark.parametrize(
    ("data", "complaint"),
    [
        (b"not json", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),
        (b"[]", "expected a JSON object"),
        (b'{"auths": []}', "'auths' is not an object"),
        (json.dumps({"auths": {HOST: "x"}}).encode(), "expected an object"),
        (json.dumps({"auths": {HOST: {"auth": 5}}}).encode(), "expected a string"),
        (json.dumps({"auths": {HOST: {"auth": "%%%"}}}).encode(), "not base64"),
        (json.dumps({"auths": {HOST: {"auth": "bm9jb2xvbg=="}}}).encode(), "no ':'"),
    ],
)
def test_malformed_config_names_the_file(data: bytes, complaint: str) -> None:
    with pytest.raises(InvalidArgument, match=complaint) as caught:
        parse_auth_config(data, HOST, source="/etc/cedana/registry.json")
    assert "/etc/cedana/registry.json" in str(caught.value)


@given(st.binary(max_size=200))
def test_any_bytes_parse_or_raise_invalid_argument(data: bytes) -> None:
    try:
        creds = parse_auth_config(data, HOST, source="cfg")
    except InvalidArgument:
        return
    assert creds is None or isinstance(creds, Credentials)


def test_secrets_stay_out_of_repr() -> None:
    text = repr(Credentials(username="me", password="hunter2", identity_token="0xfeed"))
    assert "me" in text and "hunter2" not in text and "0xfeed" not in text


def _write(path: Path, mode: int) -> Path:
    auth = base64.b64encode(b"me:pw").decode()
    path.write_text(json.dumps({"auths": {HOST: {"auth": auth}}}))
    path.chmod(mode)
    return path


def test_a_private_file_is_read(tmp_path: Path) -> None:
    path = _write(tmp_path / "config.json", 0o600)
    assert load_credentials(str(path), HOST) == Credentials(username="me", password="pw")


def test_a_symlink_to_a_private_file_is_read(tmp_path: Path) -> None:
    """Kubernetes mounts Secret keys as symlinks into ..data/."""
    target = _write(tmp_path / "real.json", 0o400)
    (tmp_path / "config.json").symlink_to(target)
    assert load_credentials(str(tmp_path / "config.json"), HOST) is not None


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644])
def test_a_file_others_can_access_is_refused(tmp_path: Path, mode: int) -> None:
    path = _write(tmp_path / "config.json", mode)
    with pytest.raises(PermissionDenied, match=f"chmod 600 {path}"):
        load_credentials(str(path), HOST)


def test_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo", 0o600)
    with pytest.raises(PermissionDenied, match="not a regular file"):
        load_credentials(str(tmp_path / "fifo"), HOST)
    with pytest.raises(PermissionDenied, match="not a regular file"):
        load_credentials(str(tmp_path), HOST)


def test_a_missing_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="unset registry_auth_file"):
        load_credentials(str(tmp_path / "absent.json"), HOST)


def test_an_oversized_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_bytes(b" " * (2 << 20))
    path.chmod(0o600)
    with pytest.raises(InvalidArgument, match="larger than"):
        load_credentials(str(path), HOST)

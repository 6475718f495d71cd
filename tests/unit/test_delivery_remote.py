"""The registry that checkpoints are delivered to: one per daemon, built again when the
credentials file changes (a rotated Secret reaches a daemon that outlives the token)."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

from cedana_shim.checkpoint.delivery import Delivery
from cedana_shim.checkpoint.remote import RemoteStore
from cedana_shim.config import NodeConfig, key_files
from store_support import make_store

HOST = "127.0.0.1:9"


def write_auth(path: Path, password: str) -> None:
    auth = base64.b64encode(f"cedana:{password}".encode()).decode()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"auths": {HOST: {"auth": auth}}}))
    tmp.chmod(0o600)
    os.rename(tmp, path)  # as the node agent installs it: a new file


def test_the_registry_is_built_once_and_again_when_its_credentials_change(
    tmp_path: Path,
) -> None:
    auth = tmp_path / "registry-auth.json"
    write_auth(auth, "first")
    config = NodeConfig(
        registry=f"{HOST}/cedana", registry_insecure=True, registry_auth_file=str(auth)
    )
    delivery = Delivery(make_store(tmp_path / "store"), config)
    first = delivery.remote()
    assert delivery.remote() is first  # nothing changed: the same client, its tokens
    assert password(first) == "first"
    write_auth(auth, "rotated")
    second = delivery.remote()
    assert password(second) == "rotated"
    assert delivery.remote() is second


def password(remote: RemoteStore) -> str:
    """What the client would present (its authenticator's credentials)."""
    client: Any = remote.client
    return str(client._http._auth._credentials.password)


def test_a_replaced_key_file_rebuilds_the_registry_with_the_new_key(tmp_path: Path) -> None:
    from test_remote_signing import write_key_pair

    private, public = write_key_pair(tmp_path, "sign")
    config = NodeConfig(
        registry=f"{HOST}/cedana",
        registry_insecure=True,
        signing_key=str(private),
        trusted_keys=str(public),
        encryption_keys=f"team-a=jwe:{public}",
    )
    assert key_files(config) == [str(private), str(public), str(public)]
    delivery = Delivery(make_store(tmp_path / "store"), config)
    first = delivery.remote()
    assert delivery.remote() is first
    os.rename(private, tmp_path / "old.key")
    new_private, _ = write_key_pair(tmp_path, "sign")  # a new key at the same path
    assert new_private == private
    assert delivery.remote() is not first

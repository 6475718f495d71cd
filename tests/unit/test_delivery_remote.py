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
from cedana_shim.config import NodeConfig
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

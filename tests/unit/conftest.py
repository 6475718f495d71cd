"""Settings of the whole unit suite."""

from __future__ import annotations

import gc

import pytest
import support.examples  # noqa: F401 - loads the quick hypothesis profile under `make unit`


def pytest_collection_finish(session: pytest.Session) -> None:
    # What collection built (modules, test items, strategies) lives to the end of the
    # run: frozen, it is left out of the full collections TaskWorld.run does after each
    # task test (0.17 s each of them before, 0.09 s after).
    gc.collect()
    gc.freeze()

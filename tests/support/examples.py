"""How many examples a property test draws.

``make test`` (CI) draws what each test asks for. The inner loop, ``make unit``,
sets ``CEDANA_TEST_EXAMPLES=quick``: a fifth of that, at least 20, and 20 where a
test asks for hypothesis's default, which cuts the unit suite's property tests
from ~20 s of CPU to ~5 s. A failure found by either is replayed first on the next
run from hypothesis's example database (``.hypothesis/``).
"""

from __future__ import annotations

import os

from hypothesis import settings

__all__ = ["examples"]

_QUICK = os.environ.get("CEDANA_TEST_EXAMPLES") == "quick"
_QUICK_MIN = 20

settings.register_profile("quick", max_examples=_QUICK_MIN)
if _QUICK:
    settings.load_profile("quick")


def examples(wanted: int) -> int:
    """``wanted`` in a full run, a fifth of it (at least 20) in a quick one."""
    return max(_QUICK_MIN, wanted // 5) if _QUICK else wanted

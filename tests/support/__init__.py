"""Test helpers shared by tests/unit and tests/privileged (on the path: pyproject)."""

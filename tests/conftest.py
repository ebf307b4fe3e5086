"""The suite runs on two pytest-xdist workers (scripts/test.sh): every test that starts real ranks
(``multiprocess``) goes to one of them, in collection order as in a serial run, and the pure tests
run on the other beside them, on the CPU the jobs leave idle while they wait on each other."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("multiprocess"):
            item.add_marker(pytest.mark.xdist_group("jobs"))

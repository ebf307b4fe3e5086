import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def a_host_without_gpus(monkeypatch):
    """The CLI tests expect what a host without a GPU answers (`ds-recycle launch` with no rank
    count starts one rank per GPU where torch sees one); in this process only, so that a GPU test
    beside them still sees the GPU. Processes the tests start ask torch themselves."""
    monkeypatch.setattr("ds_recycle.cli.nodes.cuda_device_count", lambda: 0)

"""Hypothesis draws the same examples at every run of a commit (profile ``repeatable``), so that a
verdict of the suite depends on the code, not on the draw. ``HYPOTHESIS_PROFILE=explore`` draws new
examples at each run (with ``DS_RECYCLE_FUZZ_EXAMPLES`` for more of them, see tests/cli): how the
fuzz tests look for new bad inputs; a find goes into a deterministic test beside them."""

import os
import sys
import threading

import psutil
import pytest
from hypothesis import settings

settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


WANDB_TEARDOWN_SECONDS = 60.0


@pytest.fixture(scope="session", autouse=True)
def wandb_service_ends_with_the_session():
    """W&B's service process (wandb-core), started by the runs the integration tests open in this
    process, is ended here, within WANDB_TEARDOWN_SECONDS: W&B's own exit hook waits for it without
    a bound, and one that never ended would hold the suite's process after its report forever."""
    yield
    setup = sys.modules.get("wandb.sdk.wandb_setup")
    if setup is None or setup._singleton is None:
        return
    teardown = threading.Thread(target=setup.teardown, name="wandb-teardown", daemon=True)
    teardown.start()
    teardown.join(WANDB_TEARDOWN_SECONDS)
    if teardown.is_alive():
        stuck = [p for p in psutil.Process().children() if p.name().startswith("wandb-core")]
        for process in stuck:
            process.kill()
        teardown.join(10.0)
        pytest.fail(f"W&B's service process did not end within {WANDB_TEARDOWN_SECONDS:.0f} s; killed {stuck}")

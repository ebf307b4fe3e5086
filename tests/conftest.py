"""Hypothesis draws the same examples at every run of a commit (profile ``repeatable``), so that a
verdict of the suite depends on the code, not on the draw. ``HYPOTHESIS_PROFILE=explore`` draws new
examples at each run (with ``DS_RECYCLE_FUZZ_EXAMPLES`` for more of them, see tests/cli): how the
fuzz tests look for new bad inputs; a find goes into a deterministic test beside them."""

import os

from hypothesis import settings

settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

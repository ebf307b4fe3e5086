import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "runtime"))  # recycle_job: a launch watched from outside

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")

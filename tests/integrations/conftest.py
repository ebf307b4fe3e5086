import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")

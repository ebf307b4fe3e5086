"""``python -m ds_recycle.cli ...``: the same program as the ``ds-recycle`` script."""

import sys

from ds_recycle.cli import main

sys.exit(main())

"""``python -m ds_recycle.cli ...``: the same program as the ``ds-recycle`` script."""

from ds_recycle.cli import console

console()

"""ds_recycle's logger: DeepSpeed's line format, INFO by default (DeepSpeed's own logger is at
WARNING, which would hide the one line per membership change). ``DS_RECYCLE_LOG_LEVEL`` changes it."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("ds_recycle")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(
        logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s")
    )
    logger.addHandler(_handler)
    logger.setLevel(os.environ.get("DS_RECYCLE_LOG_LEVEL", "INFO").upper())
    logger.propagate = False

"""MicroBatchFeed: the training micro-batch ``(home, mb)`` of an iteration, on any worker that runs it.

With a source (``training_data=``: a map-style dataset or an ``(iteration, home, mb)`` provider)
any worker can load any pipeline's micro-batches, so a first- or last-stage failure is survived.
Without one, data comes from ``train_batch(data_iter)``, which holds only this pipeline's
micro-batches: an iteration that a failure interrupted runs again on what it already read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ds_recycle.errors import RecycleDataError
from ds_recycle.log import logger


class MicroBatchFeed:
    """Where this worker's training micro-batches come from (see the module doc)."""

    def __init__(self, source: Callable[[int, int, int], object] | None) -> None:
        self.source = source
        """``(iteration, home, mb) -> batch``, or None when data comes from ``train_batch(data_iter)``."""
        self._read: dict[int, list] = {}
        """Own-pipeline micro-batches read from the data iterator, by iteration (the last two)."""

    @property
    def any_worker_loads(self) -> bool:
        return self.source is not None

    def batch(self, iteration: int, home: int, mb: int, own_pipeline: int, iterator: Iterator | None):
        if self.source is not None:
            return self.source(iteration, home, mb)
        if home != own_pipeline:
            raise RecycleDataError(
                f"micro-batch ({home},{mb}) belongs to another pipeline and data comes from an iterator"
            )
        read = self._read.setdefault(iteration, [])
        for old in [i for i in self._read if i < iteration - 1]:
            del self._read[old]
        if mb == len(read):
            read.append(next(iterator))
        elif mb > len(read):
            raise RuntimeError(f"schedule loads micro-batch {mb} but the data iterator is at {len(read)}")
        return read[mb]

    def warn_if_per_pipeline(self) -> None:
        if self.source is None:
            logger.warning(
                "ReCycle: data comes from train_batch(data_iter), so only a worker's own pipeline can load its "
                "micro-batches. Losing a first- or last-stage worker then stops training cleanly at that "
                "boundary. Pass training_data= (a map-style dataset or an (iteration, home, mb) provider) to "
                "ds_recycle.initialize to survive it."
            )

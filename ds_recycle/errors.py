"""The failures that cross layers: raised in the runtime or the engine, caught in another layer.

A leaf module (it imports nothing of ds_recycle), so that the engine, the runtime and the
integrations name the same classes without importing each other.
"""

from __future__ import annotations


class PeerFailure(RuntimeError):
    """A peer failed while this worker was waiting on it (or the coordinator announced a failure)."""


class MemberFailed(PeerFailure):
    """A member of the epoch being entered failed (or a failure was announced) before all entered."""


class MembershipError(RuntimeError):
    """The coordinator cannot be reached, or a request was not admitted in time."""


class EpochSuperseded(RuntimeError):
    """A newer epoch was decided while this process waited to enter an older one."""


class StageLostError(RuntimeError):
    """Every worker of a stage is gone: there is no replica left to re-route to."""


class MemoryCapError(StageLostError):
    """The plan of a failure set cannot fit under the workers' memory: the job takes the
    fallback of a lost stage (restart from the latest checkpoint, or stop)."""


class RecycleDataError(RuntimeError):
    """A plan needs micro-batches of another pipeline and the data came from an iterator."""


class PhaseError(RuntimeError):
    """A rank's runtime tried a transition that its phase table does not allow: a bug, not a failure."""

"""The harness that tests/, bench/ and examples/ share; the library itself never imports it.

- :mod:`~ds_recycle.testing.tiny`: the tiny GPT's sizes and a ``ds_config`` builder (every config
  sets ``gradient_clipping``);
- :mod:`~ds_recycle.testing.faults`: :class:`~ds_recycle.testing.faults.FaultPlan`, where a rank
  parks so that a signal sent from outside lands at an exact point of an iteration;
- :mod:`~ds_recycle.testing.launch_events`: a watcher of ``ds-recycle launch --events FILE``, the
  launcher's machine-readable event stream;
- :mod:`~ds_recycle.testing.jobs`: :class:`~ds_recycle.testing.jobs.Job`, one ``ds-recycle
  launch`` watched and signalled from outside, and the checks against a fault-free run;
- :mod:`~ds_recycle.testing.rank`: the rank script's parts (start, engine, records, pacing, helper
  processes), and :mod:`~ds_recycle.testing.worker`, the rank script the jobs run.

Importing this package imports neither torch nor DeepSpeed; the submodules that need them do.
"""


def spawn_context():
    """multiprocessing's spawn context for a harness's store clients. A spawned child imports torch
    before any of its own code runs, so :data:`~ds_recycle.runtime.shared.transport.QUIET_STORE_ENV` is set
    here, in this process's environment, which the children inherit."""
    import multiprocessing
    import os

    from ds_recycle.runtime.shared.transport import QUIET_STORE_ENV

    os.environ.update(QUIET_STORE_ENV)
    return multiprocessing.get_context("spawn")

"""The live runtime: what keeps a job training through failures, in three rooms and what they share.

- :mod:`~ds_recycle.runtime.control`: the control plane: the coordinator, its host (the job's
  store, the generation it runs) and the status page. It decides; it never trains.
- :mod:`~ds_recycle.runtime.node`: the agent of one node: the launcher (waitpid, respawn, kills),
  the node's link to the coordinator (lease, reports), the node's watch of the job's changes, the
  preloader. Node 0's agent hosts the control plane by default.
- :mod:`~ds_recycle.runtime.rank`: inside a trainer process: the recovery driver
  (:class:`~ds_recycle.runtime.rank.recovery.RankRuntime`), its membership agent, process groups,
  failure-aware waiting, re-join, reporting.
- :mod:`~ds_recycle.runtime.shared`: what the rooms speak: the store's keys and records, the job
  store (its one owner), pure policy, node placement, beats and monitor events.

A rank never imports the control plane or a node agent, nor they a rank: they meet in the store.
"""

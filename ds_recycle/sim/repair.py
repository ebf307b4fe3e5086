"""How long a dead slot is expected to stay dead: the horizon a rebalancing move is weighed over.

A dead slot of ReCycle's grid stays dead until a node arrives (a repaired or a new node re-joins,
and ReCycle puts it into the stage with the fewest live workers, which undoes the imbalance a move
would have fixed). Arrivals are taken as a Poisson process, so the expected time left until the
next one is the mean time between arrivals whatever has elapsed (memoryless). Its rate is
estimated online from the arrivals seen so far, never from future events, with one pseudo-arrival
after ``prior_s`` as the prior:

    H(now) = (now + prior_s) / (arrivals + 1)

With no arrival yet, H grows with the time waited (a trace whose nodes never come back, like
Oobleck's synthetic ones, soon makes every balancing move pay); on a spot trace with nodes coming
back every few minutes H shrinks to minutes and only large gains pay.

``prior_s`` defaults to 2 h, the repair time of the Poisson study (``--repair-hours``), an
assumption of ours (docs/simulator.md, [A]): neither the ReCycle nor the Oobleck paper reports a
repair time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_PRIOR_S = 7200.0


@dataclass
class RepairEstimate:
    prior_s: float = DEFAULT_PRIOR_S
    """The prior mean time between node arrivals (one pseudo-arrival), seconds."""
    arrivals: int = 0
    """Nodes that have arrived (re-joined or waited as spares) since the start."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.prior_s) and self.prior_s > 0):
            raise ValueError(f"repair: prior_s = {self.prior_s!r} must be a finite number > 0")

    def arrived(self, count: int) -> None:
        self.arrivals += count

    def expected_s(self, now: float) -> float:
        """Expected seconds from ``now`` until the next node arrives."""
        return (max(0.0, now) + self.prior_s) / (self.arrivals + 1)

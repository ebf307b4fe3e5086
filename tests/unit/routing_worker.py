"""One rank of tests/unit/test_routing.py: workers (0, 0) and (0, 1), ranks 0 and 1, exchange routed
messages through a PeerChannel on gloo. Writes out/rank<N>.json: the values received, or the error.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ds_recycle.engine.routing import (
    ACTIVATION,
    GRAD_NORM,
    GRADIENT,
    LOSS,
    TIED_GRADIENT,
    TIED_WEIGHT,
    P2POrderError,
    PeerChannel,
)
from ds_recycle.errors import PeerFailure
from ds_recycle.runtime.rank.groups import PairLinks
from ds_recycle.runtime.shared.records import Membership

FIRST, LAST = (0, 0), (0, 1)


class OnePipeline:
    def __init__(self, stage: int) -> None:
        self.worker = (0, stage)
        self.links = PairLinks.create()
        self.links.enter(Membership(0, (0, 1), 0), stage)

    def stage_to_global(self, stage_id: int, data: int) -> int:
        assert data == 0
        return stage_id


def activation(home: int, mb: int) -> tuple[torch.Tensor, ...]:
    return torch.full((2, 3), 10.0 * home + mb), torch.tensor([home, mb])


def gradient_buffer() -> tuple[torch.Tensor, ...]:
    return (torch.empty(2, 3),)


def scalar(value: float) -> tuple[torch.Tensor, ...]:
    return (torch.tensor([value], dtype=torch.float64),)


def agreed_order(channel: PeerChannel, stage: int, iterations: int) -> list[float]:
    """What a plan whose last stage runs micro-batch 1 before 0 lowers to (activations 1, 0 and
    gradients 1, 0), then the step's messages in the order of engine/staggered_step.py: the first
    stage owns a tied weight the last stage follows; the last stage sends the loss."""
    received = []
    for iteration in range(iterations):
        if stage == 0:
            for mb in (1, 0):
                channel.send(activation(0, mb), LAST, ACTIVATION, 0, mb)
            for mb in (1, 0):
                received.append(channel.recv_into(gradient_buffer(), LAST, GRADIENT, 0, mb)[0][0, 0].item())
            received.append(channel.recv_into(scalar(0), LAST, TIED_GRADIENT, 0, 0)[0].item())
            channel.send(scalar(100 + iteration), LAST, GRAD_NORM, 0, 0)
            received.append(channel.recv_into(scalar(0), LAST, GRAD_NORM, 0, 1)[0].item())
            channel.send(scalar(300 + iteration), LAST, TIED_WEIGHT, 0, 0)
            channel.wait_sends()
            received.append(channel.recv_into(scalar(0), LAST, LOSS)[0].item())
        else:
            for mb in (1, 0):
                tensors = channel.recv_activation(FIRST, 0, mb)
                received += [tensors[0][0, 0].item(), *tensors[1].tolist()]
            for mb in (1, 0):
                channel.send((torch.full((2, 3), -1.0 - mb),), FIRST, GRADIENT, 0, mb)
            channel.send(scalar(200 + iteration), FIRST, TIED_GRADIENT, 0, 0)
            channel.send(scalar(400 + iteration), FIRST, GRAD_NORM, 0, 1)
            channel.send(scalar(500 + iteration), FIRST, LOSS, 0, 0)
            received.append(channel.recv_into(scalar(0), FIRST, GRAD_NORM, 0, 0)[0].item())
            received.append(channel.recv_into(scalar(0), FIRST, TIED_WEIGHT, 0, 0)[0].item())
            channel.wait_sends()
    return received


def swapped(channel: PeerChannel, stage: int, iterations: int) -> list[float]:
    """The first stage sends micro-batches 0, 1 and the last stage receives 1 first; then (only
    a checked channel sees it) gradients 0, 1 taken as 1, 0."""
    if stage == 0:
        for mb in (0, 1):
            channel.send(activation(0, mb), LAST, ACTIVATION, 0, mb)
        for mb in (1, 0):
            channel.send((torch.full((2, 3), -1.0 - mb),), LAST, GRADIENT, 0, mb)
        return []
    if channel.checked:
        for mb in (0, 1):
            channel.recv_activation(FIRST, 0, mb)
        channel.recv_into(gradient_buffer(), FIRST, GRADIENT, 0, 0)
    channel.recv_activation(FIRST, 0, 1)
    return []


def absent_peer(channel: PeerChannel, stage: int, iterations: int) -> list[float]:
    """The last stage never connects; the first stage's connect is stopped by a failure flag raised
    after a second, as a survivor's watcher raises it when a peer's failure is published."""
    if stage == 1:
        return []
    threading.Timer(ABSENT_FLAG_SECONDS, channel.waiter.failed.set).start()
    began = time.monotonic()
    try:
        channel.connect({LAST}, 0)
    except PeerFailure as failure:
        return [time.monotonic() - began, str(failure)]
    return [time.monotonic() - began, "connected"]


def kept_pair(channel: PeerChannel, stage: int, iterations: int) -> list[float]:
    """The pair is connected at iteration 0 of epoch 0, and a failure cuts that iteration short
    (no one finished it): epoch 1 runs from iteration 0, so both workers forget the pair and make a
    new group. Another failure, after both finished iteration 0, cuts iteration 1 short: epoch 2
    runs from iteration 1, so the pair (connected at iteration 0) is kept and carries epoch 2's
    messages past the ones the failure abandoned. Each failure leaves an abandoned send and an
    abandoned receive: the first stage sends an activation, which the last stage (stopped by the
    failure) never receives, and waits for its gradient until the failure flag stops it. Last, the
    first stage enters an epoch without the last: the pair is forgotten."""
    links = channel.grid.links
    peer = FIRST if stage else LAST
    made = links.pairs[1 - stage].group
    received: list[float] = []
    for epoch, iteration in ((1, 0), (2, 1)):
        _abandon(channel, stage)
        dist.barrier()  # the recovery's agreement, in this test
        links.enter(Membership(epoch, (0, 1), iteration), stage)
        channel = PeerChannel(channel.grid, torch.device("cpu"))
        channel.connect({peer}, iteration)
        received += agreed_order(channel, stage, iterations)
        kept = links.pairs[1 - stage].group is made
        received.append(float(kept))
        made = links.pairs[1 - stage].group
    dist.barrier()
    if stage == 0:
        links.enter(Membership(3, (0,), 2), stage)
    return [*received, float(len(links.pairs))]


def _abandon(channel: PeerChannel, stage: int) -> None:
    if stage == 0:
        channel.send(activation(7, 7), LAST, ACTIVATION, 7, 7)
        threading.Timer(ABSENT_FLAG_SECONDS, channel.waiter.failed.set).start()
        try:
            channel.recv_into(gradient_buffer(), LAST, GRADIENT, 7, 7)
        except PeerFailure:
            pass


ABSENT_FLAG_SECONDS = 1.0
SCENARIOS = {"agreed_order": agreed_order, "swapped": swapped, "absent_peer": absent_peer, "kept_pair": kept_pair}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    channel = PeerChannel(OnePipeline(rank), torch.device("cpu"))
    if args.scenario != "absent_peer":
        channel.connect({LAST if rank == 0 else FIRST}, 0)
    result: dict = {"checked": channel.checked}
    scenario = SCENARIOS[args.scenario]
    try:
        result["received"] = scenario(channel, rank, args.iterations)
    except P2POrderError as error:
        result["error"] = str(error)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    if args.scenario == "agreed_order":
        dist.barrier()
        dist.destroy_process_group()
        return
    # gloo moves a message only once it is received: stay until the other rank is done, then
    # leave without waiting for the sends that no one will receive
    deadline = time.monotonic() + 60
    while not (args.out / f"rank{1 - rank}.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    main()

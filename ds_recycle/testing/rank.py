"""The parts of a rank script that a driver outside the job relies on: how the rank starts, the
engine it trains, the files it leaves (written atomically: a SIGKILL never leaves half a file), the
driver's pacing (``out/hold``, ``out/gate<slot>``) and the helper processes a training script
starts beside its engine.

Importing this module imports neither torch nor DeepSpeed: :func:`wait_at_gate` runs before a
respawned rank imports anything heavy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ds_recycle.testing.tiny import TINY_GPT

if TYPE_CHECKING:
    import torch

GENERATION_STRIDE = 1000
"""Records of a restarted job (generation g) are saved as incarnation 1000 g + i."""


LR_DECAY = 0.02
"""The testing job's learning rate at iteration i is lr / (1 + LR_DECAY i)."""


def slot_and_incarnation() -> tuple[int, int]:
    """This rank's slot and its record incarnation (see GENERATION_STRIDE)."""
    incarnation = int(os.environ.get("DS_RECYCLE_INCARNATION", "0"))
    generation = int(os.environ.get("DS_RECYCLE_GENERATION", "0"))
    return int(os.environ["RANK"]), incarnation + GENERATION_STRIDE * generation


def wait_at_gate(out: Path) -> None:
    """A respawned process (incarnation > 0) waits while ``out/gate<slot>`` exists, so that the
    driver chooses when a worker comes back (stdlib only: no CPU load meanwhile)."""
    if int(os.environ.get("DS_RECYCLE_INCARNATION", "0")) == 0:
        return
    gate = out / f"gate{os.environ['RANK']}"
    while gate.exists():
        time.sleep(0.05)


def start_rank() -> None:
    """Join the job's process group, on one torch thread (many ranks share a few cores)."""
    import torch

    import ds_recycle

    torch.set_num_threads(1)
    ds_recycle.init_distributed()


def build_engine(pp: int, optimizer_name: str, config: dict, data: str = "provider") -> Any:
    """The job of every membership test: the tiny GPT on the deterministic provider (or a map-style
    dataset of windows, the documented ``training_data`` contract), SGD with momentum or Adam and a
    decaying learning rate, through ``ds_recycle.initialize``; the engine records its F ledger."""
    import torch

    import ds_recycle
    from ds_recycle.testing.tiny import tiny_pipeline

    tiny = tiny_pipeline(pp)
    model = tiny.model
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer_name == "adam":
        optimizer = torch.optim.Adam(params, lr=1e-2, weight_decay=0.01)
    else:
        optimizer = torch.optim.SGD(params, lr=5e-2, momentum=0.9)
    # A decaying LR, as most jobs have: every iteration steps with its own rate, so an undone
    # finished iteration must restore the rate its step used.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda iteration: 1.0 / (1.0 + LR_DECAY * iteration))
    provider = tiny.provider(config["train_micro_batch_size_per_gpu"])
    training_data = provider if data == "provider" else WindowDataset(tiny.tokens, tiny.cfg.seq_len)
    engine, _, _, _ = ds_recycle.initialize(
        model=model, optimizer=optimizer, config=config, training_data=training_data, lr_scheduler=schedule
    )
    engine.forward_ledger = []
    return engine


class WindowDataset:
    """Next-token windows of the corpus at a fixed stride: a plain map-style dataset."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int = 7) -> None:
        self.tokens, self.seq_len, self.stride = tokens, seq_len, stride

    def __len__(self) -> int:
        return (self.tokens.numel() - self.seq_len - 1) // self.stride

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[index * self.stride : index * self.stride + self.seq_len + 1]
        return window[:-1].clone(), window[1:].clone()


def parameter_digest(engine: Any) -> list[float]:
    """The sum of every parameter in float64, in state-dict order: compared iteration by iteration
    with a fault-free run, it shows where a job first went wrong."""
    return [float(value.detach().double().sum()) for value in engine.module.state_dict().values()]


def start_helpers(out: Path, slot: int, incarnation: int) -> Iterator:
    """What a training script starts beside its engine: a DataLoader with two worker processes
    (shielded from the rank's preemption notice by ``ds_recycle.data.shield_helper``) and a plain
    forked helper process. Their PIDs go to ``out/helpers<slot>.<incarnation>``; returns an
    iterator the script draws from once per iteration."""
    import multiprocessing

    import torch

    from ds_recycle.data import shield_helper, shipped_corpus_tokens

    tokenizer, tokens = shipped_corpus_tokens()
    loader = torch.utils.data.DataLoader(
        WindowDataset(tokens, TINY_GPT.seq_len),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        worker_init_fn=shield_helper,
    )
    batches = iter(loader)
    next(batches)  # the workers are up
    forked = multiprocessing.get_context("fork").Process(target=_idle_helper, args=(os.getpid(),), daemon=True)
    forked.start()
    pids = [w.pid for w in batches._workers] + [forked.pid]
    (out / f"helpers{slot}.{incarnation}").write_text(" ".join(map(str, pids)))

    def draw():
        nonlocal batches
        while True:
            try:
                yield next(batches)
            except StopIteration:
                batches = iter(loader)

    return draw()


def _idle_helper(rank_pid: int) -> None:
    """A forked helper: it lives until its rank ends (or a signal ends it)."""
    while os.getppid() == rank_pid:
        time.sleep(0.1)


def report_progress(out: Path, slot: int, finished: int) -> None:
    """``out/progress<slot>``, replaced atomically: the driver never reads a half-written number."""
    partial = out / f"progress{slot}.partial"
    partial.write_text(str(finished))
    os.replace(partial, out / f"progress{slot}")


def wait_while_held(hold: Path, reached: Callable[[], int], period: float = 0.005) -> None:
    """The driver paces the job: while ``hold`` names an iteration this rank has ``reached``, it
    waits at the boundary (heartbeating), so that a respawned rank can re-join before the job ends."""
    while (held := _held_at(hold)) is not None and reached() >= held:
        time.sleep(period)


def _held_at(hold: Path) -> int | None:
    # The driver removes the file at any moment: a check for it before reading it would race.
    try:
        return int(hold.read_text())
    except FileNotFoundError:
        return None


def save_atomically(obj: object, path: Path) -> None:
    """A SIGKILL never leaves a half-written file: the driver reads what a killed rank saved last."""
    import torch

    partial = path.with_suffix(".partial")
    torch.save(obj, partial)
    os.replace(partial, path)

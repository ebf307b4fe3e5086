"""One rank of a membership test, started by ``ds-recycle launch`` (or respawned by it).

It trains the tiny GPT with ReCycle on the deterministic provider until ``--steps`` iterations are
done, recording every iteration's loss, the (iteration, home, mb, stage) of every F it ran, and its
progress in ``out/progress<slot>``, so that the test can time its signals. After every iteration
it saves its ledger and losses (``out/ledger<slot>.<incarnation>.pt``), which is what remains of a
rank killed by SIGKILL; whatever other way it ends (finished, or left after a SIGTERM), it writes
``out/<slot>.<incarnation>.pt`` with its final state.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import MethodType

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

import ds_recycle  # noqa: E402
from ds_recycle.data import TokenWindowProvider, shield_helper, shipped_corpus_tokens  # noqa: E402
from ds_recycle.instructions.routed import BackwardInput, BackwardWeight, ForwardPass, StaggeredStep  # noqa: E402
from ds_recycle.models import GPTConfig, build_gpt_pipeline  # noqa: E402
from ds_recycle.runtime.recovery import Phase  # noqa: E402

MODEL = dict(seq_len=16, d_model=32, n_heads=4, n_layers=2)


def main() -> None:
    args, slot, incarnation = start_rank(f"SLOT:POINT:ITERATION: park at POINT, one of {POINTS}")
    generation = int(os.environ.get("DS_RECYCLE_GENERATION", "0"))
    if generation:  # a restart of every rank from the checkpoint: files of its own, traps done
        incarnation += GENERATION_STRIDE * generation
        args.trap = []

    engine = build_engine(args.pp, args.optimizer, args.config, args.data)
    helpers = start_helpers(engine, args.out, slot, incarnation) if args.helpers else None
    for trap in args.trap:
        trap_slot, point, iteration = trap.split(":")
        if int(trap_slot) == slot and incarnation == 0:
            arm(engine, point, int(iteration), args.out, slot)
    losses: dict[int, float] = {}
    record = {"slot": slot, "incarnation": incarnation, "worker": engine.worker, "joined_at": engine.global_steps}
    try:
        while engine.global_steps < args.steps:
            wait_while_held(args.out / "hold", engine)
            if helpers is not None:
                next(helpers)  # the script's own use of its helper processes
            loss = float(engine.train_batch())
            # After a recovery the call may have re-run an earlier iteration: it returns the loss of
            # the iteration it finished last.
            losses[engine.global_steps - 1] = loss
            save_atomically(
                {"ledger": list(engine.forward_ledger), "losses": dict(losses)},
                args.out / f"ledger{slot}.{incarnation}.pt",
            )
            report_progress(args.out, slot, engine.global_steps)
        record["finished"] = True
    finally:
        record.update(
            losses=losses,
            ledger=engine.forward_ledger,
            changes=[vars(c) for c in engine.membership_changes],
            params={k: v.detach().clone() for k, v in engine.module.state_dict().items()},
            optimizer=engine.optimizer.state_dict(),
            global_steps=engine.global_steps,
        )
        save_atomically(record, args.out / f"{slot}.{incarnation}.pt")


def start_rank(trap_help: str) -> tuple[argparse.Namespace, int, int]:
    """Parse the rank script's command line (recycle_job.Job builds it), join the job's process
    group on one torch thread; returns the arguments, this rank's slot and its incarnation."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trap", action="append", default=[], help=trap_help)
    parser.add_argument(
        "--data", choices=["provider", "dataset"], default="provider", help="training_data: a provider or a dataset"
    )
    parser.add_argument("--helpers", action="store_true", help="start helper processes, as a script would")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ds_recycle.init_distributed()
    return args, int(os.environ["RANK"]), int(os.environ.get("DS_RECYCLE_INCARNATION", "0"))


def build_engine(pp: int, optimizer_name: str, config_path: Path, data: str = "provider"):
    """The job of every membership test: the tiny GPT on the deterministic provider (or a map-style
    dataset of windows, the documented ``training_data`` contract), SGD with momentum or Adam,
    through ``ds_recycle.initialize``; the engine records its F ledger."""
    tokenizer, tokens = shipped_corpus_tokens()
    cfg = GPTConfig(tokenizer.vocab_size, **MODEL)
    model = build_gpt_pipeline(cfg, num_stages=pp, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer_name == "adam":
        optimizer = torch.optim.Adam(params, lr=1e-2, weight_decay=0.01)
    else:
        optimizer = torch.optim.SGD(params, lr=5e-2, momentum=0.9)
    config = json.loads(config_path.read_text())
    provider = TokenWindowProvider(tokens, cfg.seq_len, config["train_micro_batch_size_per_gpu"], seed=0)
    training_data = provider if data == "provider" else WindowDataset(tokens, cfg.seq_len)
    engine, _, _, _ = ds_recycle.initialize(
        model=model, optimizer=optimizer, config=config, training_data=training_data
    )
    engine.forward_ledger = []
    return engine


class WindowDataset(torch.utils.data.Dataset):
    """Next-token windows of the corpus at a fixed stride: a plain map-style dataset."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int = 7) -> None:
        self.tokens, self.seq_len, self.stride = tokens, seq_len, stride

    def __len__(self) -> int:
        return (self.tokens.numel() - self.seq_len - 1) // self.stride

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[index * self.stride : index * self.stride + self.seq_len + 1]
        return window[:-1].clone(), window[1:].clone()


def start_helpers(engine, out: Path, slot: int, incarnation: int):
    """What a training script starts beside its engine: a DataLoader with two worker processes
    (shielded from the rank's preemption notice by ``ds_recycle.data.shield_helper``) and a plain
    forked helper process. Their PIDs go to ``out/helpers<slot>.<incarnation>``; returns an
    iterator the script draws from once per iteration."""
    import multiprocessing

    tokenizer, tokens = shipped_corpus_tokens()
    loader = torch.utils.data.DataLoader(
        WindowDataset(tokens, MODEL["seq_len"]),
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
    """``out/progress<slot>``, replaced atomically: the test never reads a half-written number."""
    partial = out / f"progress{slot}.partial"
    partial.write_text(str(finished))
    os.replace(partial, out / f"progress{slot}")


GENERATION_STRIDE = 1000
"""Records of a restarted job (generation g) are saved as incarnation 1000 g + i."""
POINTS = ("F", "B", "W", "allreduce", "stepped", "recovery")
PARK_SECONDS = 120.0


def arm(engine, point: str, iteration: int, out: Path, slot: int) -> None:
    """At ``point`` of ``iteration`` (the first F, B or W, the data-parallel all-reduce, right after
    the stage's optimizer step, or the start of a recovery), save the ledger, tell the test through
    ``out/trapped<slot>`` and park there, so that the test's signal lands exactly at that point.
    At "recovery" the rank does not park: the test kills it while the survivors rebuild.

    Only this engine instance is changed: the wrappers shadow its instruction map and methods."""
    fired = False

    def spring() -> None:
        nonlocal fired
        fired = True
        save_atomically({"ledger": list(engine.forward_ledger), "losses": {}}, out / f"ledger{slot}.0.pt")
        (out / f"trapped{slot}").write_text(point)
        time.sleep(PARK_SECONDS)

    def armed() -> bool:
        return not fired and engine.global_steps == iteration

    def before(run):
        def trapped(self, *args, **kwargs):
            if armed():
                spring()
            return run(self, *args, **kwargs)

        return trapped

    def after(run):
        def trapped(self, *args, **kwargs):
            result = run(self, *args, **kwargs)
            if armed():
                spring()
            return result

        return trapped

    instructions = {"F": ForwardPass, "B": BackwardInput, "W": BackwardWeight, "stepped": StaggeredStep}
    if point in ("F", "B", "W", "stepped"):
        kind = instructions[point]
        wrap = after if point == "stepped" else before
        engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, kind: wrap(engine._INSTRUCTION_MAP[kind])}
    elif point == "allreduce":
        engine.allreduce_bucket = MethodType(before(type(engine).allreduce_bucket), engine)
    elif point == "recovery":
        armed = lambda: not fired and engine.global_steps >= iteration  # noqa: E731
        engine.runtime.phase_listeners.append(lambda phase: spring() if phase is Phase.RECOVERING and armed() else None)
    else:
        raise SystemExit(f"--trap point must be one of {POINTS}, got {point!r}")


def wait_while_held(hold: Path, engine) -> None:
    """The test paces the job: while ``hold`` names an iteration this rank has reached, it waits at
    the boundary (heartbeating), so that a respawned rank can re-join before the job ends."""
    while (held := _held_at(hold)) is not None and engine.global_steps >= held:
        time.sleep(0.005)


def _held_at(hold: Path) -> int | None:
    # The test removes the file at any moment: a check for it before reading it would race.
    try:
        return int(hold.read_text())
    except FileNotFoundError:
        return None


def save_atomically(obj, path: Path) -> None:
    """A SIGKILL never leaves a half-written file: the test reads what a killed rank saved last."""
    partial = path.with_suffix(".partial")
    torch.save(obj, partial)
    os.replace(partial, path)


if __name__ == "__main__":
    main()

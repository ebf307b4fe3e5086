"""One rank of the evaluation test, under ``ds-recycle launch`` (2 stages x 2 pipelines).

It trains ``--steps`` iterations, evaluates one batch fault-free (from a ``(home, mb)`` source and
from this pipeline's iterator), then the victim SIGKILLs itself once every rank is about to
evaluate again: the survivors' evaluation is interrupted, recovered, and run again on the plan
without the victim. They evaluate once more on that plan (also with 3 micro-batches per pipeline
instead of the training's 4, as before the failure, and once from an iterator, which must refuse),
train one more iteration, and write ``out/<slot>.pt``.

Then a failure lands after a peer has finished a batch: slot 1 dies right after its evaluation
committed (``--late-victim``), while slot 0 waits a second before the evaluation's last collective,
so that it is interrupted once the failure is announced: it takes the committed loss instead of
running the batch again, and the last two workers train and evaluate on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

import ds_recycle  # noqa: E402
from ds_recycle.data import TokenWindowProvider, pipeline_iterator, shipped_corpus_tokens  # noqa: E402
from ds_recycle.errors import RecycleDataError  # noqa: E402
from ds_recycle.models import build_gpt_pipeline  # noqa: E402
from ds_recycle.testing.tiny import TINY_GPT  # noqa: E402

EVAL_ITERATION = 10_000
"""The provider's iteration index that the evaluation batches come from (never trained on)."""


def evaluate(engine, data, micro_batches: int | None = None) -> dict:
    loss = engine.eval_batch(data, num_micro_batches=micro_batches)
    evaluation = engine.evaluator.current
    return {
        "loss": float(loss),
        "shape": tuple(loss.shape),
        "attempts": evaluation.attempts,
        "failed": evaluation.failed,
        "forwards": list(evaluation.forwards),
        "seconds": evaluation.seconds,
        "from_peer": evaluation.from_peer,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--victim", type=int, default=3)
    parser.add_argument("--late-victim", type=int, default=1)
    args = parser.parse_args()
    config = json.loads(args.config)
    torch.set_num_threads(1)
    ds_recycle.init_distributed()
    slot, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tokenizer, tokens = shipped_corpus_tokens()
    cfg = TINY_GPT.config(tokenizer.vocab_size)
    model = build_gpt_pipeline(cfg, num_stages=2, seed=0)
    provider = TokenWindowProvider(tokens, cfg.seq_len, config["train_micro_batch_size_per_gpu"], seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine, *_ = ds_recycle.initialize(model=model, optimizer=optimizer, config=config, training_data=provider)
    while engine.global_steps < args.steps:
        engine.train_batch()
    m, home = engine.micro_batches, engine.grid.get_data_parallel_id()

    def source(h: int, mb: int):
        return provider.get(EVAL_ITERATION, h, mb)

    def own_iterator():
        return pipeline_iterator(provider, home, m, start_iteration=EVAL_ITERATION)

    record: dict = {"slot": slot, "worker": engine.worker, "stage": engine.stage_id}
    record["fault_free"] = evaluate(engine, source)
    record["fault_free_iterator"] = evaluate(engine, own_iterator())
    record["fault_free_3"] = evaluate(engine, source, micro_batches=3)
    (args.out / f"ready{slot}").write_text("")
    if slot == args.victim:
        while not all((args.out / f"ready{s}").exists() for s in range(world)):
            time.sleep(0.01)
        time.sleep(0.3)  # the survivors are inside their evaluation, waiting for this worker
        os.kill(os.getpid(), signal.SIGKILL)
    record["interrupted"] = evaluate(engine, source)
    record["degraded"] = evaluate(engine, source)
    record["degraded_3"] = evaluate(engine, source, micro_batches=3)
    try:
        engine.eval_batch(own_iterator())
        record["iterator_refused"] = None
    except RecycleDataError as error:
        record["iterator_refused"] = str(error)
    record["trained_after"] = float(engine.train_batch())
    record["global_steps"] = engine.global_steps
    torch.save(record, args.out / f"{slot}.pt")

    if slot == args.late_victim:
        commit = engine.evaluator._commit

        def commit_then_die(evaluation, loss) -> None:
            commit(evaluation, loss)
            os.kill(os.getpid(), signal.SIGKILL)

        engine.evaluator._commit = commit_then_die
    if slot == 0:
        reduce = engine.evaluator._loss

        def late(evaluation):
            time.sleep(1.0)
            return reduce(evaluation)

        engine.evaluator._loss = late
    record["after_commit"] = evaluate(engine, source)
    vars(engine.evaluator).pop("_loss", None)
    record["trained_last"] = float(engine.train_batch())
    record["final"] = evaluate(engine, source)
    record["final_steps"] = engine.global_steps
    torch.save(record, args.out / f"{slot}.pt")


if __name__ == "__main__":
    main()

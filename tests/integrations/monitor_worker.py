"""One rank of the W&B monitor's kill test, started by ``ds_recycle.runtime.node.launcher.launch``.

A tiny GPT (pp=2 x dp=2) trains with ReCycle on the deterministic provider, configured by
``--config`` (a ds_config with ``recycle.monitor.wandb`` and DeepSpeed's own ``wandb`` section).
The rank named by ``--kill_rank`` SIGKILLs itself once ``--kill_after`` iterations are done (it is
the W&B writer when it is rank 0), ``--kill_delay`` seconds later; the others finish ``--steps`` iterations and write
``out/<rank>.json`` with their membership changes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

import ds_recycle  # noqa: E402
from ds_recycle.data import TokenWindowProvider, shipped_corpus_tokens  # noqa: E402
from ds_recycle.models import build_gpt_pipeline  # noqa: E402
from ds_recycle.testing.tiny import TINY_GPT  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill_rank", type=int, default=-1)
    parser.add_argument("--kill_after", type=int, default=0)
    parser.add_argument("--kill_delay", type=float, default=0.0, help="seconds between the iteration and the kill")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ds_recycle.init_distributed()
    rank = int(os.environ["RANK"])

    tokenizer, tokens = shipped_corpus_tokens()
    cfg = TINY_GPT.config(tokenizer.vocab_size)
    model = build_gpt_pipeline(cfg, num_stages=2, seed=0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    config = json.loads(args.config.read_text())
    provider = TokenWindowProvider(tokens, cfg.seq_len, config["train_micro_batch_size_per_gpu"], seed=0)
    engine, _, _, _ = ds_recycle.initialize(model=model, optimizer=optimizer, config=config, training_data=provider)
    while engine.global_steps < args.steps:
        engine.train_batch()
        if rank == args.kill_rank and engine.global_steps == args.kill_after:
            time.sleep(args.kill_delay)
            os.kill(os.getpid(), signal.SIGKILL)
    record = {
        "rank": rank,
        "global_steps": engine.global_steps,
        "monitors": [type(m).__name__ for m in engine.monitors],
        "changes": [asdict(c) for c in engine.membership_changes],
    }
    (args.out / f"{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()

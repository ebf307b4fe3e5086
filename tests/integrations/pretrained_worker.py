"""One rank of the from_pretrained test (2 stages x 1 pipeline): fine-tune
``AutoModelForCausalLM.from_pretrained(argv[1])`` with ``RecycleTrainer``, evaluating before,
during (``eval_strategy`` argv[3]: "steps", every 2 of 4 steps, or "epoch", 2 epochs of 4 steps)
and after training and predicting once; write to argv[2] ``rank<N>.pt`` what the test compares
with transformers' own model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402

from ds_recycle.data import shipped_corpus_tokens  # noqa: E402
from ds_recycle.integrations.hf import RecycleTrainer, RecycleTrainingArguments  # noqa: E402

SEQ = 16
MBS = 2
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": 1.0,
    "steps_per_print": 10**6,
    "pipeline": {"stages": 2},
    "recycle": {"enabled": True, "stragglers": {"enabled": False}},  # noise must not re-plan: runs are compared
}


class CorpusWindows(Dataset):
    """Windows of the shipped corpus (ids shifted past the special tokens) from ``start`` on; every
    third row right-padded (attention mask 0, label -100)."""

    def __init__(self, samples: int, start: int) -> None:
        _, tokens = shipped_corpus_tokens()
        self.ids = torch.stack([tokens[start + i * SEQ : start + (i + 1) * SEQ] + 3 for i in range(samples)])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.ids[index].clone()
        mask = torch.ones_like(ids)
        if index % 3 == 2:
            mask[SEQ - 5 :] = 0
            ids[mask == 0] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Seen(TrainerCallback):
    def __init__(self) -> None:
        self.evaluated: list[tuple[int, dict]] = []
        self.predicted: list[dict] = []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluated.append((state.global_step, dict(metrics)))

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        self.predicted.append(dict(metrics))


def micro_batch(dataset: Dataset, first: int) -> dict[str, torch.Tensor]:
    rows = [dataset[i] for i in range(first, first + MBS)]
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def hf_eval_loss(model, dataset: Dataset) -> float:
    """transformers' own model over the eval set: the mean of the micro-batches' losses."""
    model.eval()
    with torch.no_grad():
        losses = [float(model(**micro_batch(dataset, first)).loss) for first in range(0, len(dataset), MBS)]
    return sum(losses) / len(losses)


def main() -> None:
    model_dir, out, strategy = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    schedule = {"max_steps": 4, "eval_steps": 2} if strategy == "steps" else {"num_train_epochs": 2}
    args = RecycleTrainingArguments(
        output_dir=str(out / "run"),
        deepspeed=DS_CONFIG,
        per_device_train_batch_size=MBS,
        per_device_eval_batch_size=MBS,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        max_grad_norm=1.0,
        eval_strategy=strategy,
        **schedule,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    train = CorpusWindows(32 if strategy == "steps" else 16, start=0)  # 16: 4 steps an epoch
    evalset = CorpusWindows(14, start=20_000)  # 7 micro-batches: 3 batches of 2, then 1
    seen = Seen()
    trainer = RecycleTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        args=args,
        train_dataset=train,
        eval_dataset=evalset,
        callbacks=[seen],
    )
    before = trainer.evaluate()
    engine = trainer.engine
    first = micro_batch(evalset, 0)
    loss, logits = engine.eval_batch(
        lambda home, mb: trainer._pipeline_collate([evalset[i] for i in range(MBS)]),
        return_logits=True,
        num_micro_batches=1,
    )
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        expected = reference(**first)
    record = {
        "stage": engine.stage_id,
        "before": before,
        "reference_before": hf_eval_loss(reference, evalset),
        "logits": None if logits is None else logits.detach().clone(),
        "reference_logits": expected.logits,
        "first_loss": float(loss),
        "reference_first_loss": float(expected.loss),
    }
    trainer.train()
    record["after"] = trainer.evaluate()
    record["predicted"] = trainer.predict(evalset).metrics
    trainer.save_model(str(out / "final"))
    torch.distributed.barrier()  # the leader writes the index and config.json after the shards
    saved = AutoModelForCausalLM.from_pretrained(out / "final")
    record.update(
        reference_after=hf_eval_loss(saved, evalset),
        log_history=trainer.state.log_history,
        evaluated=seen.evaluated,
        predicted_callbacks=seen.predicted,
    )
    torch.save(record, out / f"rank{engine.global_rank}.pt")


if __name__ == "__main__":
    main()

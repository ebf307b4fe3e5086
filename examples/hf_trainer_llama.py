"""Train a small LLaMA with HF ``Trainer`` on a ReCycle pipeline (pipeline x data parallel), on CPU.

    deepspeed --num_gpus 4 examples/hf_trainer_llama.py \\
        --deepspeed ds_configs/hf_llama_recycle.json --output_dir /tmp/hf_llama --max_steps 50

(``ds-recycle launch`` starts it the same way when workers may fail.) Compared with a plain HF
script only three things change: the import, ``Trainer``/``TrainingArguments`` ->
``RecycleTrainer``/``RecycleTrainingArguments``, and ``--deepspeed`` pointing at a config with
``pipeline.stages`` and a ``recycle`` section.

The model is built from a ``LlamaConfig`` (nothing is downloaded); the data are fixed-length
windows of the corpus shipped with ds_recycle, tokenized by characters, with some rows
right-padded so that the attention mask is exercised. ``--eval_samples N`` adds an eval set
(windows shifted by half a window), evaluated at ``--eval_strategy`` and after training, with the
perplexity. ``--dump_params DIR`` writes each rank's final parameters (used by the tests).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import HfArgumentParser, LlamaConfig  # noqa: E402

from ds_recycle.data import shipped_corpus_tokens  # noqa: E402
from ds_recycle.integrations.hf import RecycleTrainer, RecycleTrainingArguments, to_hf_state_dict  # noqa: E402

PAD = 0


@dataclass
class ModelArguments:
    hidden_size: int = field(default=64)
    num_layers: int = field(default=4)
    num_heads: int = field(default=4)
    seq_len: int = field(default=32)
    samples: int = field(default=1024, metadata={"help": "training windows drawn from the corpus"})
    eval_samples: int = field(default=0, metadata={"help": "eval windows (0: no eval set)"})
    tie_word_embeddings: bool = field(default=True)
    dump_params: str | None = field(default=None, metadata={"help": "write rank<N>.pt with final parameters here"})


class CorpusWindows(Dataset):
    """Window i of the char-tokenized corpus (ids shifted by one so that 0 is the pad token); every
    fourth window keeps only its first 3/4 and pads the rest."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, samples: int):
        stride = max(1, (tokens.numel() - seq_len) // samples)
        self.windows = [tokens[i * stride : i * stride + seq_len] + 1 for i in range(samples)]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.windows[index].clone()
        mask = torch.ones_like(ids)
        if index % 4 == 3:
            mask[3 * len(ids) // 4 :] = 0
            ids[mask == 0] = PAD
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    parser = HfArgumentParser((ModelArguments, RecycleTrainingArguments))
    model_args, args = parser.parse_args_into_dataclasses()
    torch.set_num_threads(1)  # several CPU ranks share this host's cores

    tokenizer, tokens = shipped_corpus_tokens()
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size + 1,
        hidden_size=model_args.hidden_size,
        intermediate_size=2 * model_args.hidden_size,
        num_hidden_layers=model_args.num_layers,
        num_attention_heads=model_args.num_heads,
        num_key_value_heads=max(1, model_args.num_heads // 2),
        max_position_embeddings=model_args.seq_len,
        tie_word_embeddings=model_args.tie_word_embeddings,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
    )
    eval_dataset = None
    if model_args.eval_samples:
        eval_dataset = CorpusWindows(tokens[model_args.seq_len // 2 :], model_args.seq_len, model_args.eval_samples)
    trainer = RecycleTrainer(
        model=config,
        args=args,
        train_dataset=CorpusWindows(tokens, model_args.seq_len, model_args.samples),
        eval_dataset=eval_dataset,
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(os.path.join(args.output_dir, "final"))
    metrics = {}
    if eval_dataset is not None:
        metrics = trainer.evaluate()
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
        trainer.log_metrics("eval", metrics)

    if model_args.dump_params:
        os.makedirs(model_args.dump_params, exist_ok=True)
        rank = trainer.engine.global_rank
        torch.save(
            {
                "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                "hf_params": {k: v.detach().clone() for k, v in to_hf_state_dict(trainer.model).items()},
                "stage": trainer.engine.stage_id,
                "log_history": trainer.state.log_history,
                "eval_metrics": metrics,
                "global_step": trainer.state.global_step,
                "leader": trainer.is_world_process_zero(),
            },
            os.path.join(model_args.dump_params, f"rank{rank}.pt"),
        )


if __name__ == "__main__":
    main()

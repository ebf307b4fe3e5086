"""The tiny GPT that tests, benchmarks and examples train, and the DeepSpeed configs they use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ds_recycle.data import TokenWindowProvider
    from ds_recycle.models import GPTConfig


@dataclass(frozen=True)
class TinyGPT:
    """Sizes of a GPT small enough for many CPU ranks on one host (the vocabulary is the shipped
    corpus's)."""

    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2

    def config(self, vocab_size: int) -> GPTConfig:
        from ds_recycle.models import GPTConfig

        return GPTConfig(
            vocab_size, seq_len=self.seq_len, d_model=self.d_model, n_heads=self.n_heads, n_layers=self.n_layers
        )

    def script_args(self) -> list[str]:
        """The same sizes as examples/train_gpt.py's arguments."""
        return [
            *("--layers", str(self.n_layers), "--d-model", str(self.d_model)),
            *("--heads", str(self.n_heads), "--seq-len", str(self.seq_len)),
        ]


TINY_GPT = TinyGPT()


@dataclass
class TinyPipeline:
    """This rank's stage of the tiny GPT and the corpus it trains on."""

    model: torch.nn.Module
    cfg: GPTConfig
    tokens: torch.Tensor

    def provider(self, micro_batch_size: int) -> TokenWindowProvider:
        """The deterministic provider every run reads (seed 0)."""
        from ds_recycle.data import TokenWindowProvider

        return TokenWindowProvider(self.tokens, self.cfg.seq_len, micro_batch_size, seed=0)


def tiny_pipeline(pp: int, seed: int = 0, checkpoint: int = 0) -> TinyPipeline:
    """The tiny GPT in ``pp`` stages from ``seed``, with activation checkpointing every
    ``checkpoint`` layers (0: none)."""
    from ds_recycle.data import shipped_corpus_tokens
    from ds_recycle.models import build_gpt_pipeline

    tokenizer, tokens = shipped_corpus_tokens()
    cfg = TINY_GPT.config(tokenizer.vocab_size)
    model = build_gpt_pipeline(cfg, num_stages=pp, seed=seed, activation_checkpoint_interval=checkpoint)
    return TinyPipeline(model, cfg, tokens)


def ds_config(
    micro_batches: int,
    clip: float,
    recycle: dict[str, Any] | None = None,
    *,
    micro_batch_size: int = 2,
    **sections: Any,
) -> dict[str, Any]:
    """A DeepSpeed config: ``micro_batches`` micro-batches of ``micro_batch_size`` per iteration,
    ``gradient_clipping`` ``clip`` (0: off), the ``recycle`` section as given (None: none, stock
    DeepSpeed), and any other top-level ``sections`` (``optimizer``, ``csv_monitor``, ...)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "steps_per_print": 10**9,
        "gradient_clipping": clip,
        **sections,
    }
    if recycle is not None:
        config["recycle"] = recycle
    return config

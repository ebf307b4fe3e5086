"""Deterministic micro-batch data, keyed by (iteration, home pipeline, micro-batch).

Whoever runs a micro-batch, its home pipeline's worker or a peer covering a failed first or
last stage, loads the same samples. ``pipeline_iterator`` turns a provider into the per-pipeline
iterator that DeepSpeed's ``train_batch(data_iter)`` consumes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

SHIPPED_CORPUS = Path(__file__).with_name("corpus.txt")


@dataclass
class CharTokenizer:
    alphabet: str

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.alphabet)}
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    def decode(self, tokens) -> str:
        return "".join(self.alphabet[int(t)] for t in tokens)


@dataclass
class TokenWindowProvider:
    """Next-token windows of ``seq_len`` drawn from ``tokens`` at offsets chosen by a generator
    seeded with (seed, iteration, home, mb): random access, no state."""

    tokens: torch.Tensor
    seq_len: int
    micro_batch_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.tokens.numel() < self.seq_len + 2:
            raise ValueError(f"corpus has {self.tokens.numel()} tokens, fewer than seq_len + 2 = {self.seq_len + 2}")

    def get(self, iteration: int, home: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(((self.seed * 1_000_003 + iteration) * 1009 + home) * 65_537 + mb)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.micro_batch_size,), generator=gen)
        windows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def pipeline_iterator(provider, home: int, microbatches: int, start_iteration: int = 0) -> Iterator:
    """Micro-batches of pipeline ``home`` in DeepSpeed's order: iteration by iteration, mb 0..m-1."""
    iteration = start_iteration
    while True:
        for mb in range(microbatches):
            yield provider.get(iteration, home, mb)
        iteration += 1


def shipped_corpus_tokens() -> tuple[CharTokenizer, torch.Tensor]:
    text = SHIPPED_CORPUS.read_text()
    tokenizer = CharTokenizer.from_text(text)
    return tokenizer, tokenizer.encode(text)

"""Deterministic micro-batch data, keyed by (iteration, home pipeline, micro-batch).

Whoever runs a micro-batch, its home pipeline's worker or a peer covering a failed first or
last stage, loads the same samples. ``pipeline_iterator`` turns a provider into the per-pipeline
iterator that DeepSpeed's ``train_batch(data_iter)`` consumes.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler, default_collate

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


@dataclass
class DatasetMicroBatches:
    """Micro-batch ``(home, mb)`` of iteration ``i`` from a map-style dataset: exactly the batch that
    stock DeepSpeed's pipeline loader gives pipeline ``home`` at that point (a ``DistributedSampler``
    over D replicas without shuffling, batches of ``micro_batch_size``, repeated epoch after epoch).
    Any worker can load any pipeline's micro-batch, so a failure changes no sample."""

    dataset: object
    pipelines: int
    micro_batches: int
    micro_batch_size: int
    collate_fn: Callable | None = None
    drop_last: bool = False
    _indices: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for home in range(self.pipelines):
            sampler = DistributedSampler(self.dataset, num_replicas=self.pipelines, rank=home, shuffle=False)
            self._indices[home] = list(sampler)
        per_pipeline = len(self._indices[0])
        self.batches_per_epoch = (
            per_pipeline // self.micro_batch_size if self.drop_last else math.ceil(per_pipeline / self.micro_batch_size)
        )
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"training_data has {len(self.dataset)} samples: fewer than one micro-batch of {self.micro_batch_size} "
                f"for each of {self.pipelines} pipelines"
            )

    def __call__(self, iteration: int, home: int, mb: int):
        batch = (iteration * self.micro_batches + mb) % self.batches_per_epoch
        indices = self._indices[home][batch * self.micro_batch_size : (batch + 1) * self.micro_batch_size]
        return (self.collate_fn or default_collate)([self.dataset[i] for i in indices])


def pipeline_iterator(provider, home: int, microbatches: int, start_iteration: int = 0) -> Iterator:
    """Micro-batches of pipeline ``home`` in DeepSpeed's order: iteration by iteration, mb 0..m-1."""
    iteration = start_iteration
    while True:
        for mb in range(microbatches):
            yield provider.get(iteration, home, mb)
        iteration += 1


def shield_helper(worker_id: int | None = None) -> None:
    """A ``worker_init_fn`` for the DataLoaders of a script under ``ds-recycle launch``.

    A cluster delivers a preemption notice (SIGTERM, SIGINT, SIGHUP) to every process of a rank's
    tree. For the rank it means "leave at the next iteration boundary"; a DataLoader worker would
    die of it (torch installs its own SIGTERM handler there) and take the rank's data iterator with
    it. With this, the worker ignores the notice and ends with its rank."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


def shipped_corpus_tokens() -> tuple[CharTokenizer, torch.Tensor]:
    text = SHIPPED_CORPUS.read_text()
    tokenizer = CharTokenizer.from_text(text)
    return tokenizer, tokenizer.encode(text)

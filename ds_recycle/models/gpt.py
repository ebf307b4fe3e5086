"""A small GPT: token embedding tied between the first and last stage, learned positions,
pre-LN blocks (causal self-attention, GELU MLP), a final LayerNorm and the tied LM head.

The same layer list builds a DeepSpeed ``PipelineModule`` and a single-process reference whose
parameter names are the pipeline's (``"<layer index>.<name>"`` and ``"tied_modules.embed.*"``),
so the state dicts of all stages load into the reference as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

TIED_KEY = "embed"


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 4
    mlp_ratio: int = 4


class TokenEmbedding(nn.Embedding):
    """The tied weight: an embedding on the first stage and the LM head on the last."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__(vocab_size, d_model)
        nn.init.normal_(self.weight, std=0.02)


def lm_head(embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, embedding.weight)


class PositionEmbedding(nn.Module):
    def __init__(self, seq_len: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[: x.shape[1]]


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(), nn.Linear(mlp_ratio * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _layers(cfg: GPTConfig) -> list[tuple[str, type, tuple]]:
    """(role, class, args) per layer; the tied embedding appears first and last."""
    body = [("layer", PositionEmbedding, (cfg.seq_len, cfg.d_model))]
    body += [("layer", Block, (cfg.d_model, cfg.n_heads, cfg.mlp_ratio))] * cfg.n_layers
    body += [("layer", nn.LayerNorm, (cfg.d_model,))]
    embed = (TokenEmbedding, (cfg.vocab_size, cfg.d_model))
    return [("embed", *embed), *body, ("head", *embed)]


def build_gpt_pipeline(
    cfg: GPTConfig,
    num_stages: int,
    seed: int = 0,
    partition_method: str = "uniform",
    activation_checkpoint_interval: int = 0,
    topology=None,
):
    """A ``PipelineModule`` of the GPT. Needs torch.distributed initialized (DeepSpeed's rule).
    ``topology``: a DeepSpeed ``ProcessTopology`` (default: DeepSpeed's stage-major numbering;
    ``ds_recycle.pipeline_major_topology`` keeps a pipeline on a node)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    specs = []
    for role, cls, args in _layers(cfg):
        if role == "layer":
            specs.append(LayerSpec(cls, *args))
        else:
            forward_fn = lm_head if role == "head" else None
            specs.append(TiedLayerSpec(TIED_KEY, cls, *args, forward_fn=forward_fn))
    return PipelineModule(
        layers=specs,
        num_stages=num_stages,
        loss_fn=lm_loss,
        partition_method=partition_method,
        base_seed=seed,
        seed_layers=True,
        activation_checkpoint_interval=activation_checkpoint_interval,
        topology=topology,
    )


class GPTReference(nn.Module):
    """The pipeline's function in one module, with the pipeline's parameter names."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tied_modules = nn.ModuleDict()
        self.order: list[str] = []
        for index, (role, cls, args) in enumerate(_layers(cfg)):
            if role == "layer":
                self.add_module(str(index), cls(*args))
                self.order.append(str(index))
            elif role == "embed":
                self.tied_modules[TIED_KEY] = cls(*args)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embed = self.tied_modules[TIED_KEY]
        x = embed(tokens)
        for name in self.order:
            x = getattr(self, name)(x)
        return lm_head(embed, x)

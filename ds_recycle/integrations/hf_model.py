"""A HuggingFace causal LM as a DeepSpeed ``PipelineModule``, built from its config alone.

``causal_lm_pipeline(config, num_stages)`` lays a ``PretrainedConfig`` out as pipeline layers::

    embed (tied with the head when the config ties them)   (input_ids, attention_mask) -> (h, mask)
    [GPT-2: position embedding + dropout]                  (h, mask) -> (h, mask)
    decoder layer 0 .. L-1                                 (h, mask) -> (h, mask)
    final norm                                             (h, mask) -> h
    LM head (the tied embedding's weight, or its own)      h -> logits

Only the hidden state (float) and the 2-D integer attention mask cross a stage boundary: every
stage rebuilds HF's 4-D causal mask and its rotary embeddings itself, with HF's own functions, so
the pipeline computes what ``AutoModelForCausalLM.from_config(config)`` computes, bit for bit, for
the same weights. The modules are HF's own classes, initialized with the model's ``_init_weights``.

``to_hf_state_dict`` / ``from_hf_state_dict`` map parameter names both ways.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TIED_KEY = "embed"
LLAMA_LIKE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Model types with the Llama layout (embed_tokens, layers, norm, rotary_emb, lm_head) checked
bitwise against HF; others with that layout are accepted by ``allow_unverified=True``."""
GPT2_MODEL_TYPES = ("gpt2",)


class HFPipelineError(ValueError):
    """The config describes a model that ``causal_lm_pipeline`` cannot lay out as pipeline layers."""


@dataclass(frozen=True)
class Layout:
    """Where a CausalLM keeps its parts, as attribute paths from the CausalLM instance."""

    embed: str
    layers: str
    norm: str
    head: str
    rotary: str | None = None
    position: str | None = None
    dropout: str | None = None


LLAMA_LAYOUT = Layout(
    embed="model.embed_tokens", layers="model.layers", norm="model.norm", head="lm_head", rotary="model.rotary_emb"
)
GPT2_LAYOUT = Layout(
    embed="transformer.wte",
    layers="transformer.h",
    norm="transformer.ln_f",
    head="lm_head",
    position="transformer.wpe",
    dropout="transformer.drop",
)


class ModelSource:
    """The CausalLM built once per process on the meta device (no memory, no init): it gives each
    pipeline layer HF's module classes, resolved config (attention implementation included) and
    ``_init_weights``. The layers themselves are copied off it and materialized on the CPU."""

    def __init__(self, config, allow_unverified: bool = False):
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
        self.model_class = type(model)
        self.config = model.config
        self.layout = _layout_of(model, allow_unverified)
        self.num_layers = len(_get(model, self.layout.layers))
        self.tied = _get(model, self.layout.head).weight is _get(model, self.layout.embed).weight
        self.loss_function = model.loss_function
        self._meta: nn.Module | None = model

    def module(self, path: str) -> nn.Module:
        """A CPU copy of the meta model's module at ``path``, initialized as HF initializes it."""
        if self._meta is None:
            raise RuntimeError("the pipeline is built; this source holds no model any more")
        return self.initialize(copy.deepcopy(_get(self._meta, path)).to_empty(device="cpu"))

    def rotary(self) -> nn.Module:
        """Rotary embeddings hold buffers only; HF's constructor computes them."""
        return type(_get(self._meta, self.layout.rotary))(config=self.config)

    def initialize(self, module: nn.Module) -> nn.Module:
        """Apply the model's ``_init_weights`` to every submodule, children first (as HF does)."""
        init = _Initializer.of(self.model_class, self.config)
        with torch.no_grad():
            for sub in _post_order(module):
                init._init_weights(sub)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise HFPipelineError(f"{self.model_class.__name__}._init_weights left {name} uninitialized")
        return module

    def release(self) -> None:
        self._meta = None


class _Initializer:
    """An instance of the HF model class with only ``config`` set: enough to call its
    ``_init_weights`` (which uses ``self.config`` and ``super()``) without building the model."""

    _cache: dict[tuple[type, int], Any] = {}

    @classmethod
    def of(cls, model_class: type, config) -> Any:
        key = (model_class, id(config))
        if key not in cls._cache:
            instance = model_class.__new__(model_class)
            nn.Module.__init__(instance)
            instance.config = config
            cls._cache = {key: instance}
        return cls._cache[key]


# ---- pipeline layers ---------------------------------------------------------------------------


class EmbedPipe(nn.Module):
    """``(input_ids, attention_mask) -> (inputs_embeds, attention_mask)``. With a tied head, the
    last stage holds a second copy (DeepSpeed keeps the two in sync) whose ``lm_head`` computes logits."""

    def __init__(self, source: ModelSource):
        super().__init__()
        self.embed_tokens = source.module(source.layout.embed)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, attention_mask = inputs
        return self.embed_tokens(input_ids), attention_mask


def tied_lm_head(embed: EmbedPipe, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, embed.embed_tokens.weight)


class PositionPipe(nn.Module):
    """GPT-2's learned positions and embedding dropout."""

    def __init__(self, source: ModelSource):
        super().__init__()
        self.wpe = source.module(source.layout.position)
        self.drop = source.module(source.layout.dropout)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, attention_mask = inputs
        position_ids = _position_ids(embeds)
        return self.drop(embeds + self.wpe(position_ids)), attention_mask


class DecoderLayerPipe(nn.Module):
    """One HF decoder layer. It rebuilds the 4-D mask (and, for Llama-style models, the rotary
    embeddings) from the 2-D mask, as the HF base model does once before its first layer."""

    def __init__(self, source: ModelSource, index: int):
        super().__init__()
        self.config = source.config
        self.layer = source.module(f"{source.layout.layers}.{index}")
        self.rotary_emb = source.rotary() if source.layout.rotary else None

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        from transformers.masking_utils import create_causal_mask

        hidden, attention_mask = inputs
        position_ids = _position_ids(hidden)
        # No KV cache. The cache is the 4th argument, passed by position: transformers 5.24 renamed it
        # from `past_key_values` to `cache` (the old name warns, FutureWarning, until its removal in
        # 5.40), and 5.23 knows only the old one. The decoder layers' cache defaults to None.
        mask = create_causal_mask(self.config, hidden, attention_mask, None, position_ids=position_ids)
        if self.rotary_emb is None:
            hidden = self.layer(hidden, None, mask, None, use_cache=False, position_ids=position_ids)
        else:
            hidden = self.layer(
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=False,
                position_embeddings=self.rotary_emb(hidden, position_ids=position_ids),
            )
        return hidden, attention_mask


class NormPipe(nn.Module):
    def __init__(self, source: ModelSource):
        super().__init__()
        self.norm = source.module(source.layout.norm)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.norm(inputs[0])


class LMHeadPipe(nn.Module):
    """An untied LM head."""

    def __init__(self, source: ModelSource):
        super().__init__()
        self.lm_head = source.module(source.layout.head)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


@dataclass(frozen=True)
class CausalLMLoss:
    """HF's loss for the model (``model.loss_function``: labels shifted inside, -100 ignored, mean
    over the valid tokens of the micro-batch)."""

    loss_function: Any
    vocab_size: int

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size)


# ---- the pipeline ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HFNames:
    """Parameter names of the pipeline <-> HF's state dict of the CausalLM."""

    prefixes: tuple[tuple[str, str], ...]
    """(pipeline prefix, HF prefix), e.g. ("3.layer.", "model.layers.2.")."""
    tied_hf_keys: tuple[str, ...] = ()
    """HF keys that alias the embedding when tied (``lm_head.weight``)."""
    model_type: str = ""

    def to_hf(self, name: str) -> str:
        for pipe, hf in self.prefixes:
            if name.startswith(pipe):
                return hf + name[len(pipe) :]
        raise KeyError(f"pipeline parameter {name!r} has no HF name")

    def from_hf(self, name: str) -> str | None:
        """The pipeline name of HF parameter ``name``; None for a tied alias."""
        if name in self.tied_hf_keys:
            return None
        for pipe, hf in self.prefixes:
            if name.startswith(hf):
                return pipe + name[len(hf) :]
        raise KeyError(f"HF parameter {name!r} has no pipeline name")


@dataclass
class CausalLMPipelineInfo:
    """What ``causal_lm_pipeline`` attaches to the module as ``module.hf``."""

    config: Any
    model_class: type
    names: HFNames
    tied: bool
    num_layers: int
    layer_kinds: list[str] = field(default_factory=list)


def causal_lm_pipeline(
    config,
    num_stages: int,
    *,
    partition_method: str = "type:DecoderLayerPipe",
    activation_checkpoint_interval: int = 0,
    seed: int = 1234,
    allow_unverified: bool = False,
    topology=None,
):
    """A ``deepspeed.pipe.PipelineModule`` of ``AutoModelForCausalLM.from_config(config)``.

    Nothing is downloaded. Each layer is seeded with ``seed + layer index`` (so the initial weights
    do not depend on ``num_stages``) and initialized with the model's ``_init_weights``. The
    module's ``hf`` attribute (:class:`CausalLMPipelineInfo`) carries the config and name map.
    Batches are ``((input_ids, attention_mask), labels)``; see :func:`pipeline_batch`.
    Needs torch.distributed initialized, as every ``PipelineModule`` does."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    source = ModelSource(config, allow_unverified)
    layout, L = source.layout, source.num_layers
    specs: list = []
    kinds: list[str] = []
    prefixes: list[tuple[str, str]] = []
    if source.tied:
        specs.append(TiedLayerSpec(TIED_KEY, EmbedPipe, source, tied_weight_attr="embed_tokens.weight"))
        prefixes.append((f"tied_modules.{TIED_KEY}.embed_tokens.", layout.embed + "."))
    else:
        specs.append(LayerSpec(EmbedPipe, source))
        prefixes.append(("0.embed_tokens.", layout.embed + "."))
    kinds.append("embed")
    if layout.position:
        index = len(specs)
        specs.append(LayerSpec(PositionPipe, source))
        prefixes.append((f"{index}.wpe.", layout.position + "."))
        kinds.append("position")
    for i in range(L):
        index = len(specs)
        specs.append(LayerSpec(DecoderLayerPipe, source, i))
        prefixes.append((f"{index}.layer.", f"{layout.layers}.{i}."))
        kinds.append("decoder")
    index = len(specs)
    specs.append(LayerSpec(NormPipe, source))
    prefixes.append((f"{index}.norm.", layout.norm + "."))
    kinds.append("norm")
    if source.tied:
        specs.append(
            TiedLayerSpec(TIED_KEY, EmbedPipe, source, forward_fn=tied_lm_head, tied_weight_attr="embed_tokens.weight")
        )
    else:
        index = len(specs)
        specs.append(LayerSpec(LMHeadPipe, source))
        prefixes.append((f"{index}.lm_head.", layout.head + "."))
    kinds.append("head")

    module = PipelineModule(
        layers=specs,
        num_stages=None if topology is not None else num_stages,
        topology=topology,
        loss_fn=CausalLMLoss(source.loss_function, source.config.vocab_size),
        partition_method=partition_method,
        activation_checkpoint_interval=activation_checkpoint_interval,
        base_seed=seed,
        seed_layers=True,
        seed_fn=_seed_layer,
    )
    source.release()
    names = HFNames(tuple(prefixes), (layout.head + ".weight",) if source.tied else (), source.config.model_type)
    module.hf = CausalLMPipelineInfo(source.config, source.model_class, names, source.tied, L, kinds)
    return module


def to_hf_state_dict(module, state_dict: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """This stage's parameters under HF names (the tied embedding only from the stage that holds
    the input embedding, so stages' dicts never overlap)."""
    info: CausalLMPipelineInfo = module.hf
    state_dict = module.state_dict() if state_dict is None else state_dict
    first = getattr(module, "_local_start", 0) == 0
    out = {}
    for name, tensor in state_dict.items():
        if name.startswith(f"tied_modules.{TIED_KEY}.") and not first:
            continue
        out[info.names.to_hf(name)] = tensor
    return out


def from_hf_state_dict(module, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``hf_state_dict`` that this stage holds, under pipeline names."""
    info: CausalLMPipelineInfo = module.hf
    wanted = set(module.state_dict())
    out = {}
    for name, tensor in hf_state_dict.items():
        pipe = info.names.from_hf(name)
        if pipe is not None and pipe in wanted:
            out[pipe] = tensor
    return out


def load_hf_state_dict(module, hf_state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy HF weights into this stage's layers; every local parameter must be present."""
    local = from_hf_state_dict(module, hf_state_dict)
    missing = sorted(set(module.state_dict()) - set(local))
    if missing:
        raise KeyError(f"HF state dict lacks {len(missing)} parameters of this stage, e.g. {missing[0]}")
    module.load_state_dict(local, strict=True)


def pipeline_batch(batch: Mapping[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A HF batch dict (``input_ids``, optional ``attention_mask`` and ``labels``) as the pipeline
    batch ``((input_ids, attention_mask), labels)``. Missing labels are the inputs, with padding
    positions set to -100 (what ``DataCollatorForLanguageModeling(mlm=False)`` produces)."""
    input_ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask.to(torch.long)
    labels = batch.get("labels")
    if labels is None:
        labels = input_ids.masked_fill(mask == 0, -100)
    return (input_ids, mask), labels


# ---- helpers ---------------------------------------------------------------------------------


def _seed_layer(seed) -> None:
    """DeepSpeed's default seed function, given a Python int: with a ``type:`` partition the
    layer index is a numpy integer, which ``random.seed`` rejects on Python >= 3.11."""
    from deepspeed.runtime.utils import set_random_seed

    set_random_seed(int(seed))


def _position_ids(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _layout_of(model: nn.Module, allow_unverified: bool) -> Layout:
    model_type = model.config.model_type
    if model_type in GPT2_MODEL_TYPES:
        return GPT2_LAYOUT
    has_llama_parts = all(_has(model, p) for p in ("model.embed_tokens", "model.layers", "model.norm", "lm_head"))
    if has_llama_parts and _has(model, "model.rotary_emb"):
        if model_type in LLAMA_LIKE_MODEL_TYPES or allow_unverified:
            return LLAMA_LAYOUT
        raise HFPipelineError(
            f"model_type {model_type!r} has the Llama layout but its forward was not checked against "
            f"HF bit for bit (checked: {', '.join(LLAMA_LIKE_MODEL_TYPES + GPT2_MODEL_TYPES)}); "
            "pass allow_unverified=True to build it anyway"
        )
    raise HFPipelineError(
        f"model_type {model_type!r} ({type(model).__name__}) is not supported: causal_lm_pipeline needs the "
        f"Llama layout (model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head) or GPT-2"
    )


def _get(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = root[int(part)] if re.fullmatch(r"\d+", part) else getattr(root, part)
    return root


def _has(root: nn.Module, path: str) -> bool:
    try:
        _get(root, path)
    except (AttributeError, IndexError):
        return False
    return True


def _post_order(module: nn.Module) -> Iterable[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module

"""Tiny HF configs for the integration tests (hidden 32, 2 layers, vocab 100): built from config
objects, nothing downloaded."""

from __future__ import annotations

VOCAB = 100


def llama(tied: bool = True):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def gpt2():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)


CONFIGS = {"llama_tied": lambda: llama(True), "llama_untied": lambda: llama(False), "gpt2": gpt2}

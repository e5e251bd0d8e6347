"""A tiny random Llama for tests that need a real model but not a trained one (exports, benches,
misuse checks run in seconds): seeded, in eval mode."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(*, vocab_size: int = 64, hidden_size: int = 32, intermediate_size: int = 64,
               max_position_embeddings: int = 128) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position_embeddings)
    return LlamaForCausalLM(config).eval()

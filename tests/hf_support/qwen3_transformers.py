"""One-time check of wgpar's Qwen3 against Hugging Face transformers (not run by CI: it needs
torch and transformers, which the tests' requirements do not carry).

Usage: python qwen3_transformers.py WGPAR_BINARY SCRATCH_DIR

Makes a tiny random Qwen3ForCausalLM (heads wider than hidden / heads, tied embeddings, query
and key projections scaled up so the per-head norms matter), saves it with save_pretrained
(safetensors, config.json), runs greedy decoding in transformers in float64 on the prompts
`wgpar run` makes itself (`--batch 2 --prompt-len 8`: ids (7919 b + 104729 i) mod vocab), then
`wgpar run --logits-out` on the saved folder on one device, tensor-parallel over 2 and as a
2-stage pipeline (virtual devices; f32 KV cache), and on one device with the default KV cache,
and prints per strategy whether the generated ids agree and
the largest relative error of wgpar's logits over every step.
"""

import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from transformers_check import VOCAB, init_uniform, main


def tiny_model():
    torch.manual_seed(1234)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        attention_bias=False,
    )
    model = Qwen3ForCausalLM(config)
    return init_uniform(model, 0.5, 1.5, query_key_scale)


def query_key_scale(name):
    """Query and key projections drawn 3x wider, so that the per-head norms matter."""
    return 3.0 if "q_proj" in name or "k_proj" in name else 1.0


if __name__ == "__main__":
    sys.exit(main(tiny_model))

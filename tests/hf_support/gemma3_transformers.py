"""One-time check of wgpar's Gemma 3 text model against Hugging Face transformers (not run by
CI: it needs torch and transformers, which the tests' requirements do not carry).

Usage: python gemma3_transformers.py WGPAR_BINARY SCRATCH_DIR

Makes a tiny random Gemma3ForCausalLM (4 layers: sliding, sliding, global, sliding with a
window of 4 and their own RoPE base; 4 heads of 24 over a stream of 80, 2 KV heads; query
scale 20^-1/2; final soft-cap 3; norm scales stored as w for 1 + w; tied embeddings), saves
it with save_pretrained, runs greedy decoding in transformers in float64 (eager attention) on
the prompts `wgpar run` makes itself (`--batch 2 --prompt-len 8`: ids (7919 b + 104729 i) mod
vocab), then `wgpar run --logits-out` on the saved folder on one device, tensor-parallel over
2 and as a 2-stage pipeline (virtual devices; f32 KV cache), and on one device with the
default KV cache, and prints per strategy whether the generated ids agree and the largest
relative error of wgpar's logits over every step.
"""

import sys

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from transformers_check import VOCAB, init_uniform, main


def tiny_model():
    torch.manual_seed(1234)
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=80,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=20,
        sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        final_logit_softcapping=3.0,
        tie_word_embeddings=True,
        attention_bias=False,
        attn_implementation="eager",
    )
    model = Gemma3ForCausalLM(config)
    # Norm scales stored as w for a multiplier of 1 + w: multipliers in 0.5 .. 1.5.
    return init_uniform(model, -0.5, 0.5)


if __name__ == "__main__":
    sys.exit(main(tiny_model))

"""One-time check of wgpar's partial rotary (Phi-4-mini) against Hugging Face transformers (not
run by CI: it needs torch and transformers, which the tests' requirements do not carry).

Usage: python phi3_partial_transformers.py WGPAR_BINARY SCRATCH_DIR

Makes a tiny random Phi3ForCausalLM shaped as Phi-4-mini is, smaller: 4 heads of 32 over 128
(2 KV heads), `partial_rotary_factor` 0.75 (RoPE turns the first 24 values of each head, the
other 8 pass), LongRoPE lists of 12 values (one per rotated pair) with max_position_embeddings
128 over an original 4, so transformers and wgpar both rotate by the long list, and a tied
head as Phi-4-mini has. Compared as transformers_check.py does (ids and logits per strategy).
"""

import sys

import torch
from transformers import Phi3Config, Phi3ForCausalLM

from transformers_check import VOCAB, init_uniform, main

SHORT = [1.0 + 0.25 * i for i in range(12)]
LONG = [1.0 + 0.5 * i * i for i in range(12)]


def tiny_model():
    torch.manual_seed(2468)
    config = Phi3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        original_max_position_embeddings=4,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
        sliding_window=None,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    return init_uniform(Phi3ForCausalLM(config), 0.5, 1.5)


if __name__ == "__main__":
    sys.exit(main(tiny_model))

"""One-time check of wgpar's LongRoPE against Hugging Face transformers (not run by CI: it
needs torch and transformers, which the tests' requirements do not carry).

Usage: python phi3_longrope_transformers.py WGPAR_BINARY SCRATCH_DIR

Makes a tiny random Phi3ForCausalLM (as phi3_transformers.py, 8 heads of 16: 8 rotated pairs)
with `rope_scaling` of type longrope and distinct short and long factor lists, twice:
- long: max_position_embeddings 128, original 4. Every sequence transformers sees here (8 to 19
  tokens) is past 4 tokens, so it rotates by the long list; wgpar serves its default context
  (128 > 4) and picks the long list too.
- short: max_position_embeddings 128, original 64. Transformers' sequences stay within 64, so
  it rotates by the short list; wgpar is run with `--max-seq 64` and picks the short list.
Both apply the attention factor sqrt(1 + ln(128 / original) / ln(original)) to cos and sin.
Each is compared as transformers_check.py does (ids and logits per strategy).
"""

import sys

import torch
from transformers import Phi3Config, Phi3ForCausalLM

from transformers_check import VOCAB, init_uniform, main

SHORT = [1.0 + 0.25 * i for i in range(8)]
LONG = [1.0 + 0.5 * i * i for i in range(8)]


def tiny_model(original):
    def make():
        torch.manual_seed(4321)
        config = Phi3Config(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=192,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=128,
            original_max_position_embeddings=original,
            rms_norm_eps=1e-5,
            rope_theta=10_000.0,
            rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
            sliding_window=None,
            tie_word_embeddings=False,
            pad_token_id=0,
        )
        return init_uniform(Phi3ForCausalLM(config), 0.5, 1.5)

    return make


if __name__ == "__main__":
    long = main(tiny_model(4), name="long")
    short = main(tiny_model(64), wgpar_args=["--max-seq", "64"], name="short")
    sys.exit(long or short)

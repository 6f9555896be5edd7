"""One-time check of wgpar's Phi-3 against Hugging Face transformers (not run by CI: it needs
torch and transformers, which the tests' requirements do not carry).

Usage: python phi3_transformers.py WGPAR_BINARY SCRATCH_DIR

Makes a tiny random Phi3ForCausalLM (3 layers, 8 heads of 16 over 128, 2 KV heads, fused
qkv_proj and gate_up_proj as transformers stores them, untied head), saves it with
save_pretrained, runs greedy decoding in transformers in float64 on the prompts `wgpar run`
makes itself (`--batch 2 --prompt-len 8`: ids (7919 b + 104729 i) mod vocab), then
`wgpar run --logits-out` on the saved folder on one device, tensor-parallel over 2 and as a
2-stage pipeline (virtual devices; f32 KV cache), and on one device with the default KV cache,
and prints per strategy whether the generated ids agree and the largest relative error of
wgpar's logits over every step.
"""

import sys

import torch
from transformers import Phi3Config, Phi3ForCausalLM

from transformers_check import VOCAB, init_uniform, main


def tiny_model():
    torch.manual_seed(1234)
    config = Phi3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
        original_max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        sliding_window=None,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    model = Phi3ForCausalLM(config)
    return init_uniform(model, 0.5, 1.5)


if __name__ == "__main__":
    sys.exit(main(tiny_model))

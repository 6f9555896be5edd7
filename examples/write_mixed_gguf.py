"""Writes a Llama-shaped GGUF of random blocks typed as llama.cpp's Q4_K_M mix (token_embd and
most matrices Q4_K; attn_v, ffn_down and output Q6_K; norms F32), for the figures of
examples/gguf_native.rs. Random blocks: valid bytes with small f16 scales, no quantizer.

Usage: python write_mixed_gguf.py OUT.gguf [--hidden N --layers N --ffn N --vocab N ...]
(defaults: the small model of the figures; larger shapes measure host and device memory)
"""
import argparse

import numpy as np
import gguf

T = gguf.GGMLQuantizationType
rng = np.random.default_rng(5)


def blocks(qtype, rows, cols):
    block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows, cols // block_len, block_bytes), dtype=np.uint8)
    # f16 scales small enough that values stay O(0.05): Q4_K d and dmin first, Q6_K d last.
    def put(at, lo, hi):
        d = rng.uniform(lo, hi, size=b.shape[:2]).astype(np.float16)
        b[:, :, at:at + 2] = d.view(np.uint8).reshape(*b.shape[:2], 2)
    if qtype == T.Q4_K:
        put(0, 1e-4, 3e-4)
        put(2, 1e-4, 3e-4)
    elif qtype == T.Q6_K:
        put(208, 2e-5, 6e-5)
    return b.reshape(rows, -1)


def shape():
    p = argparse.ArgumentParser(description="random Q4_K_M-mix Llama GGUF")
    p.add_argument("out")
    for name, default in [("hidden", 512), ("layers", 4), ("heads", 8), ("kv-heads", 2),
                          ("head-dim", 64), ("ffn", 1536), ("vocab", 2048), ("context", 512)]:
        p.add_argument(f"--{name}", type=int, default=default)
    return p.parse_args()


def main():
    a = shape()
    HIDDEN, LAYERS, HEADS, KV_HEADS = a.hidden, a.layers, a.heads, a.kv_heads
    HEAD_DIM, FFN, VOCAB, CONTEXT = a.head_dim, a.ffn, a.vocab, a.context
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name("mixed-q4_k_m")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_uint32("tokenizer.ggml.eos_token_id", 0)
    w.add_tensor("token_embd.weight", blocks(T.Q4_K, VOCAB, HIDDEN), raw_dtype=T.Q4_K)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.add_tensor("output.weight", blocks(T.Q6_K, VOCAB, HIDDEN), raw_dtype=T.Q6_K)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        for name, qtype, rows, cols in [
            ("attn_q", T.Q4_K, q, HIDDEN), ("attn_k", T.Q4_K, kv, HIDDEN),
            ("attn_v", T.Q6_K, kv, HIDDEN), ("attn_output", T.Q4_K, HIDDEN, q),
            ("ffn_gate", T.Q4_K, FFN, HIDDEN), ("ffn_up", T.Q4_K, FFN, HIDDEN),
            ("ffn_down", T.Q6_K, HIDDEN, FFN),
        ]:
            w.add_tensor(f"blk.{i}.{name}.weight", blocks(qtype, rows, cols), raw_dtype=qtype)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()

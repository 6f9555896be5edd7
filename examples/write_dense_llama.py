"""Writes a Llama-shaped GGUF of random F16 matrices (F32 norms) with a small SentencePiece-style
vocabulary, as input for llama.cpp's llama-quantize: examples/quant_speed.sh makes each packed
type from it, so wgpar and llama.cpp run the same files. The vocabulary exists so llama.cpp
loads the file (its loader needs one); the runs feed random token ids.

Usage: python write_dense_llama.py OUT.gguf [--hidden N --layers N --ffn N --vocab N ...]
(defaults: hidden 2048, 2 layers, vocabulary 8192: wide matrices, small enough for a CPU driver)
"""
import argparse

import numpy as np
import gguf

rng = np.random.default_rng(11)


def args():
    p = argparse.ArgumentParser(description="random dense (F16) Llama GGUF with a vocabulary")
    p.add_argument("out")
    for name, default in [("hidden", 2048), ("layers", 2), ("heads", 16), ("kv-heads", 4),
                          ("ffn", 5632), ("vocab", 8192), ("context", 512)]:
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args()
    if a.hidden % a.heads or a.heads % a.kv_heads or a.vocab < 260:
        p.error("hidden must divide by heads, heads by kv-heads, and vocab be at least 260")
    return a


def matrix(rows, cols):
    # Values of about the size trained weights have: the packed types' scales stay ordinary.
    return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)


def add_vocab(w, vocab):
    # <unk>, <s>, </s>, the 256 byte tokens SentencePiece falls back to, then plain pieces.
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [f"\u2581p{i}" for i in range(vocab - len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * (vocab - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(vocab - 259)])
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def main():
    a = args()
    head_dim = a.hidden // a.heads
    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name("dense-llama")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(a.context)
    w.add_embedding_length(a.hidden)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ffn)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    add_vocab(w, a.vocab)
    w.add_tensor("token_embd.weight", matrix(a.vocab, a.hidden))
    w.add_tensor("output_norm.weight", np.ones(a.hidden, dtype=np.float32))
    w.add_tensor("output.weight", matrix(a.vocab, a.hidden))
    kv = a.kv_heads * head_dim
    for i in range(a.layers):
        for name, rows, cols in [
            ("attn_q", a.hidden, a.hidden), ("attn_k", kv, a.hidden), ("attn_v", kv, a.hidden),
            ("attn_output", a.hidden, a.hidden), ("ffn_gate", a.ffn, a.hidden),
            ("ffn_up", a.ffn, a.hidden), ("ffn_down", a.hidden, a.ffn),
        ]:
            w.add_tensor(f"blk.{i}.{name}.weight", matrix(rows, cols))
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(a.hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()

"""Writes the llama-quantize fixtures of tests/gguf_llamaquant.rs (issue 38: files written by
llama.cpp's own quantizer, not by gguf-py's block writer).

Usage: python llamaquant_fixtures.py LLAMA_QUANTIZE OUT_DIR

LLAMA_QUANTIZE is llama.cpp's `llama-quantize` (../shared/tools/llamacpp.sh builds one). The
script writes a one-layer random Llama in F32 (hidden 256, so every matrix holds whole
256-value K blocks; vocabulary 64; weights drawn like a trained model's, Gaussian with a few
outliers, so the quantizer's scale search has something to do), then asks llama-quantize for
one file per type with `--pure` (every tensor in that type) and one Q4_K_M mix, and removes
the F32 source. The files are committed: the README's test command cannot build llama.cpp.
"""
import os
import subprocess
import sys

import numpy as np
import gguf

HIDDEN, FFN, VOCAB, HEADS, KV_HEADS, HEAD_DIM, CONTEXT = 256, 256, 64, 4, 2, 64, 64
PURE_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
              "Q6_K", "IQ4_NL", "IQ4_XS"]


def weights(rng, rows, cols):
    w = rng.normal(0.0, 1.0 / np.sqrt(cols), size=(rows, cols)).astype(np.float32)
    # A few large values per matrix, as trained weights have.
    idx = rng.integers(0, w.size, size=max(1, w.size // 512))
    w.reshape(-1)[idx] *= 6.0
    return w


def write_source(path):
    rng = np.random.default_rng(38)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("wgpar llama-quantize fixture")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_eos_token_id(0)
    kv = KV_HEADS * HEAD_DIM
    writer.add_tensor("token_embd.weight", weights(rng, VOCAB, HIDDEN))
    writer.add_tensor("output_norm.weight", (1.0 + 0.1 * rng.normal(size=HIDDEN)).astype(np.float32))
    writer.add_tensor("output.weight", weights(rng, VOCAB, HIDDEN))
    p = "blk.0."
    writer.add_tensor(p + "attn_norm.weight", (1.0 + 0.1 * rng.normal(size=HIDDEN)).astype(np.float32))
    writer.add_tensor(p + "attn_q.weight", weights(rng, HIDDEN, HIDDEN))
    writer.add_tensor(p + "attn_k.weight", weights(rng, kv, HIDDEN))
    writer.add_tensor(p + "attn_v.weight", weights(rng, kv, HIDDEN))
    writer.add_tensor(p + "attn_output.weight", weights(rng, HIDDEN, HIDDEN))
    writer.add_tensor(p + "ffn_norm.weight", (1.0 + 0.1 * rng.normal(size=HIDDEN)).astype(np.float32))
    writer.add_tensor(p + "ffn_gate.weight", weights(rng, FFN, HIDDEN))
    writer.add_tensor(p + "ffn_up.weight", weights(rng, FFN, HIDDEN))
    writer.add_tensor(p + "ffn_down.weight", weights(rng, HIDDEN, FFN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main():
    quantize, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    source = os.path.join(out, "source-f32.gguf")
    write_source(source)
    jobs = [(t, ["--pure"], f"pure-{t.lower()}.gguf") for t in PURE_TYPES]
    jobs.append(("Q4_K_M", [], "q4_k_m.gguf"))
    for qtype, flags, name in jobs:
        cmd = [quantize, *flags, source, os.path.join(out, name), qtype]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.remove(source)


if __name__ == "__main__":
    main()

"""Dequantizes raw ggml blocks with llama.cpp's `gguf` package (its numpy reference code).

Usage: python dequantize.py TYPE IN OUT

IN holds whole blocks of ggml type TYPE (e.g. Q5_K); OUT receives their values as
little-endian f32. The Rust tests use it as the independent reference for wgpar's readers.
"""
import sys

import numpy as np
import gguf
from gguf import quants


def main():
    qtype = gguf.GGMLQuantizationType[sys.argv[1]]
    block_len, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.fromfile(sys.argv[2], dtype=np.uint8)
    blocks = raw.reshape(-1, block_bytes)
    values = quants.dequantize(blocks, qtype).astype(np.float32).reshape(-1)
    assert values.size == blocks.shape[0] * block_len
    values.tofile(sys.argv[3])


if __name__ == "__main__":
    main()

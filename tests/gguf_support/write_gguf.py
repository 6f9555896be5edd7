"""Writes a GGUF file with llama.cpp's `gguf` package from a manifest the Rust tests make.

Usage: python write_gguf.py MANIFEST.json

The manifest names the output file, the architecture, metadata entries ([key, kind, value],
kind one of u32, f32, bool, str, str_array, f32_array, i32_array) and tensors: each a raw
little-endian f32 file (or, with "packed", bytes already in the GGML type) with its shape
outermost first. "quantize" asks this package's own quantizer for the type; "permute_heads"
applies the converter's Q/K row permutation for llama.cpp's interleaved RoPE. For every
quantized tensor, the package's dequantization is written beside the input as FILE.deq (f32),
so the Rust side can check its own dequantization against llama.cpp's reference code.
"""
import json
import sys

import numpy as np
import gguf
from gguf import quants

KINDS = {
    "u32": "add_uint32",
    "f32": "add_float32",
    "bool": "add_bool",
    "str": "add_string",
}


def permute(w, n_head):
    # As llama.cpp's converter does for llama-architecture q_proj / k_proj.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def add_meta(writer, key, kind, value):
    if kind in KINDS:
        getattr(writer, KINDS[kind])(key, value)
    elif kind == "str_array":
        writer.add_array(key, [str(v) for v in value])
    elif kind == "f32_array":
        writer.add_key_value(key, [float(v) for v in value], gguf.GGUFValueType.ARRAY,
                             sub_type=gguf.GGUFValueType.FLOAT32)
    elif kind == "i32_array":
        writer.add_key_value(key, [int(v) for v in value], gguf.GGUFValueType.ARRAY,
                             sub_type=gguf.GGUFValueType.INT32)
    else:
        raise ValueError(f"unknown kind {kind}")


def add_tensor(writer, t):
    qtype = gguf.GGMLQuantizationType[t.get("type", "F32")]
    shape = t["shape"]
    if t.get("packed"):
        raw = np.fromfile(t["file"], dtype=np.uint8)
        row_bytes = raw.size // int(np.prod(shape[:-1]))
        data = raw.reshape(*shape[:-1], row_bytes)
        writer.add_tensor(t["name"], data, raw_dtype=qtype)
    else:
        data = np.fromfile(t["file"], dtype=np.float32).reshape(shape)
        if t.get("permute_heads"):
            data = permute(data, t["permute_heads"])
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t["name"], data)
            return
        if qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(t["name"], data.astype(np.float16))
            return
        data = quants.quantize(data, qtype)
        writer.add_tensor(t["name"], data, raw_dtype=qtype)
    if qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        quants.dequantize(data, qtype).astype(np.float32).tofile(t["file"] + ".deq")


def main():
    with open(sys.argv[1]) as f:
        m = json.load(f)
    writer = gguf.GGUFWriter(m["path"], m["arch"])
    for key, kind, value in m["meta"]:
        add_meta(writer, key, kind, value)
    for t in m["tensors"]:
        add_tensor(writer, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()

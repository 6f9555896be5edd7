// Reading ggml blocks (Q8_0, Q4_0, Q4_K, Q6_K) as GGUF stores them, shared by the kernels on
// packed weights: the host appends this file to matmul_quant.wgsl and embedding_quant.wgsl,
// each of which declares the packed buffer `w` (array<u32>; blocks' bytes picked out of its
// words, so rows need no padding). Every type keeps one scale and offset per 16 values:
// value = scale * q - offset. QTYPE (ggml's type id) selects the layout.

// ggml type ids: 8 Q8_0, 2 Q4_0, 12 Q4_K, 14 Q6_K.
override QTYPE: u32 = 8u;

fn block_len() -> u32 {
    return select(32u, 256u, QTYPE == 12u || QTYPE == 14u);
}

fn block_bytes() -> u32 {
    switch QTYPE {
        case 2u: { return 18u; }
        case 12u: { return 144u; }
        case 14u: { return 210u; }
        default: { return 34u; }
    }
}

fn byte_at(a: u32) -> u32 {
    return (w[a >> 2u] >> ((a & 3u) * 8u)) & 0xffu;
}

fn half_at(a: u32) -> f32 {
    return unpack2x16float(byte_at(a) | (byte_at(a + 1u) << 8u)).x;
}

fn signed_byte(b: u32) -> i32 {
    return bitcast<i32>(b << 24u) >> 24u;
}

// Scale and offset of chunk c (values 16c .. 16c + 16) of the block at byte a.
fn chunk_scale(a: u32, c: u32) -> vec2<f32> {
    switch QTYPE {
        case 2u: {
            let d = half_at(a);
            return vec2<f32>(d, 8.0 * d);
        }
        case 12u: {
            // Eight 6-bit scales and mins packed in 12 bytes, one pair per 32 values.
            let s = c / 2u;
            let sb = a + 4u;
            var sc: u32;
            var mn: u32;
            if (s < 4u) {
                sc = byte_at(sb + s) & 63u;
                mn = byte_at(sb + s + 4u) & 63u;
            } else {
                sc = (byte_at(sb + s + 4u) & 0xfu) | ((byte_at(sb + s - 4u) >> 6u) << 4u);
                mn = (byte_at(sb + s + 4u) >> 4u) | ((byte_at(sb + s) >> 6u) << 4u);
            }
            return vec2<f32>(half_at(a) * f32(sc), half_at(a + 2u) * f32(mn));
        }
        case 14u: {
            let v0 = c * 16u;
            let r0 = v0 % 128u;
            let sc = signed_byte(byte_at(a + 192u + 8u * (v0 / 128u) + (r0 % 32u) / 16u + 2u * (r0 / 32u)));
            let s = half_at(a + 208u) * f32(sc);
            return vec2<f32>(s, 32.0 * s);
        }
        default: {
            return vec2<f32>(half_at(a), 0.0);
        }
    }
}

// Quant j (0..16) of chunk c of the block at byte a, before scale and offset.
fn chunk_q(a: u32, c: u32, j: u32) -> f32 {
    switch QTYPE {
        case 2u: {
            // Values 0..16 are the low nibbles of the 16 bytes, 16..32 the high ones.
            let b = byte_at(a + 2u + j);
            return f32(select(b & 0xfu, b >> 4u, c == 1u));
        }
        case 12u: {
            // 64 values per 32 bytes: low nibbles first, then high.
            let s = c / 2u;
            let b = byte_at(a + 16u + 32u * (s / 2u) + 16u * (c % 2u) + j);
            return f32((b >> (4u * (s % 2u))) & 0xfu);
        }
        case 14u: {
            // 128 values per 64 low-nibble bytes and 32 high-pair bytes.
            let v0 = c * 16u;
            let h = v0 / 128u;
            let r0 = v0 % 128u;
            let qq = r0 / 32u;
            let l = r0 % 32u + j;
            let lb = byte_at(a + 64u * h + l + 32u * (qq & 1u));
            let low = select(lb & 0xfu, lb >> 4u, qq >= 2u);
            let hb = (byte_at(a + 128u + 32u * h + l) >> (2u * qq)) & 3u;
            return f32(low | (hb << 4u));
        }
        default: {
            return f32(signed_byte(byte_at(a + 2u + 16u * c + j)));
        }
    }
}

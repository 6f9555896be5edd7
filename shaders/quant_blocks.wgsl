// Reading ggml blocks as GGUF stores them, shared by the kernels on packed weights: the host
// appends this file to matmul_quant.wgsl and embedding_quant.wgsl, each of which declares the
// packed buffer `w` (array<u32>; blocks' bytes picked out of its words, so rows need no
// padding). Every type keeps one scale and offset per 16 values: value = scale * q - offset
// (for IQ4_NL and IQ4_XS, q is the level its nibble indexes). QTYPE (ggml's type id) selects
// the layout; the host makes one pipeline per type, so each switch folds to one case.

// ggml type ids: 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 10 Q2_K, 11 Q3_K, 12 Q4_K, 13 Q5_K,
// 14 Q6_K, 20 IQ4_NL, 23 IQ4_XS.
override QTYPE: u32 = 8u;

// IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl).
var<private> IQ4_LEVELS: array<f32, 16> = array<f32, 16>(
    -127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
    1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0,
);

fn block_len() -> u32 {
    switch QTYPE {
        case 10u, 11u, 12u, 13u, 14u, 23u: { return 256u; }
        default: { return 32u; }
    }
}

fn block_bytes() -> u32 {
    switch QTYPE {
        case 2u, 20u: { return 18u; }
        case 3u: { return 20u; }
        case 6u: { return 22u; }
        case 7u: { return 24u; }
        case 10u: { return 84u; }
        case 11u: { return 110u; }
        case 12u: { return 144u; }
        case 13u: { return 176u; }
        case 14u: { return 210u; }
        case 23u: { return 136u; }
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

// Q4_K's and Q5_K's scale and min of 32-value sub-block s: eight 6-bit pairs in the 12 bytes
// after d and dmin.
fn k4_scale(a: u32, s: u32) -> vec2<f32> {
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

// Scale and offset of chunk c (values 16c .. 16c + 16) of the block at byte a.
fn chunk_scale(a: u32, c: u32) -> vec2<f32> {
    switch QTYPE {
        case 2u: {
            let d = half_at(a);
            return vec2<f32>(d, 8.0 * d);
        }
        case 3u, 7u: {
            // d, then the min m added to every value.
            return vec2<f32>(half_at(a), -half_at(a + 2u));
        }
        case 6u: {
            let d = half_at(a);
            return vec2<f32>(d, 16.0 * d);
        }
        case 10u: {
            // A byte per chunk: 4-bit scale of d, 4-bit min of dmin.
            let sc = byte_at(a + c);
            return vec2<f32>(half_at(a + 80u) * f32(sc & 0xfu), half_at(a + 82u) * f32(sc >> 4u));
        }
        case 11u: {
            // Sixteen 6-bit scales biased by 32: low 4 bits in bytes 0..8, high 2 in 8..12.
            let low = (byte_at(a + 96u + c % 8u) >> (4u * (c / 8u))) & 0xfu;
            let high = (byte_at(a + 104u + c % 4u) >> (2u * (c / 4u))) & 3u;
            let s = half_at(a + 108u) * f32(i32(low | (high << 4u)) - 32);
            return vec2<f32>(s, 4.0 * s);
        }
        case 12u, 13u: {
            return k4_scale(a, c / 2u);
        }
        case 14u: {
            let v0 = c * 16u;
            let r0 = v0 % 128u;
            let sc = signed_byte(byte_at(a + 192u + 8u * (v0 / 128u) + (r0 % 32u) / 16u + 2u * (r0 / 32u)));
            let s = half_at(a + 208u) * f32(sc);
            return vec2<f32>(s, 32.0 * s);
        }
        case 23u: {
            // Sub-block s = c / 2: 4 low scale bits in byte 4 + s / 2, 2 high in the u16 at 2.
            let s = c / 2u;
            let low = (byte_at(a + 4u + s / 2u) >> (4u * (s % 2u))) & 0xfu;
            let high = ((byte_at(a + 2u) | (byte_at(a + 3u) << 8u)) >> (2u * s)) & 3u;
            return vec2<f32>(half_at(a) * f32(i32(low | (high << 4u)) - 32), 0.0);
        }
        default: {
            // Q8_0 and IQ4_NL: d alone.
            return vec2<f32>(half_at(a), 0.0);
        }
    }
}

// Nibble j of a 32-value block's 16 nibble bytes at byte q: low nibbles are values 0..16
// (chunk 0), high nibbles 16..32 (chunk 1).
fn nibble(q: u32, c: u32, j: u32) -> u32 {
    let b = byte_at(q + j);
    return select(b & 0xfu, b >> 4u, c == 1u);
}

// Bit 16c + j of the 4 bytes of fifth bits at byte h, as 16 or 0.
fn fifth_bit(h: u32, c: u32, j: u32) -> u32 {
    let i = 16u * c + j;
    return ((byte_at(h + i / 8u) >> (i % 8u)) & 1u) << 4u;
}

// Quant j (0..16) of chunk c of the block at byte a, before scale and offset.
fn chunk_q(a: u32, c: u32, j: u32) -> f32 {
    switch QTYPE {
        case 2u: {
            return f32(nibble(a + 2u, c, j));
        }
        case 3u: {
            return f32(nibble(a + 4u, c, j));
        }
        case 6u: {
            return f32(nibble(a + 6u, c, j) | fifth_bit(a + 2u, c, j));
        }
        case 7u: {
            return f32(nibble(a + 8u, c, j) | fifth_bit(a + 4u, c, j));
        }
        case 10u: {
            // 2-bit values: 32 bytes per 128 values, four values (bit pairs) per byte.
            let b = byte_at(a + 16u + 32u * (c / 8u) + 16u * (c % 2u) + j);
            return f32((b >> (2u * ((c % 8u) / 2u))) & 3u);
        }
        case 11u: {
            // Q2_K's layout, plus a third bit from the 32 mask bytes (clear: minus 4).
            let b = byte_at(a + 32u + 32u * (c / 8u) + 16u * (c % 2u) + j);
            let h = (byte_at(a + 16u * (c % 2u) + j) >> (4u * (c / 8u) + (c % 8u) / 2u)) & 1u;
            return f32(((b >> (2u * ((c % 8u) / 2u))) & 3u) | (h << 2u));
        }
        case 12u: {
            // 64 values per 32 bytes: low nibbles first, then high.
            let s = c / 2u;
            let b = byte_at(a + 16u + 32u * (s / 2u) + 16u * (c % 2u) + j);
            return f32((b >> (4u * (s % 2u))) & 0xfu);
        }
        case 13u: {
            // Q4_K's nibbles after 32 bytes of fifth bits: value l of sub-block s in bit s of
            // byte l.
            let s = c / 2u;
            let l = 16u * (c % 2u) + j;
            let b = byte_at(a + 48u + 32u * (s / 2u) + l);
            let h = (byte_at(a + 16u + l) >> s) & 1u;
            return f32(((b >> (4u * (s % 2u))) & 0xfu) | (h << 4u));
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
        case 20u: {
            return IQ4_LEVELS[nibble(a + 2u, c, j)];
        }
        case 23u: {
            // Sub-block s = c / 2 of 32 values in 16 bytes, as IQ4_NL's.
            return IQ4_LEVELS[nibble(a + 8u + 16u * (c / 2u), c % 2u, j)];
        }
        default: {
            return f32(signed_byte(byte_at(a + 2u + 16u * c + j)));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Whole-word readers: the kernels that read a block four values at a time. Every ggml block is
// an even number of bytes, so every field of every block starts 2-byte aligned in `w`.

// The 4 bytes at byte a (2-byte aligned): one load when a is 4-aligned, else the halves of two
// neighbouring words.
fn word_at(a: u32) -> u32 {
    let i = a >> 2u;
    if ((a & 2u) == 0u) {
        return w[i];
    }
    return (w[i] >> 16u) | (w[i + 1u] << 16u);
}

// The 4 bytes of v, each shifted right by `shift` and masked with `mask`.
fn bytes4(v: u32, shift: u32, mask: u32) -> vec4<u32> {
    return (vec4<u32>(v) >> (vec4<u32>(0u, 8u, 16u, 24u) + shift)) & vec4<u32>(mask);
}

// The 4 bytes of v as signed 8-bit values.
fn signed4(v: u32) -> vec4<f32> {
    let s = bitcast<vec4<i32>>(vec4<u32>(v) << vec4<u32>(24u, 16u, 8u, 0u));
    return vec4<f32>(s >> vec4<u32>(24u));
}

fn levels4(q: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(IQ4_LEVELS[q.x], IQ4_LEVELS[q.y], IQ4_LEVELS[q.z], IQ4_LEVELS[q.w]);
}

// Quants 4g .. 4g + 4 (g in 0..4) of chunk c of the block at byte a, before scale and offset
// (chunk_q's values), from whole-word loads.
fn chunk_quad(a: u32, c: u32, g: u32) -> vec4<f32> {
    // Nibble types keep chunk 0 in the low nibbles of 16 bytes and chunk 1 in the high ones.
    let nib = 4u * (c % 2u);
    switch QTYPE {
        case 2u: {
            return vec4<f32>(bytes4(word_at(a + 2u + 4u * g), nib, 0xfu));
        }
        case 3u: {
            return vec4<f32>(bytes4(word_at(a + 4u + 4u * g), nib, 0xfu));
        }
        case 6u, 7u: {
            // Q5_1 has the min before the fifth bits.
            let h = select(2u, 4u, QTYPE == 7u);
            let low = bytes4(word_at(a + h + 4u + 4u * g), nib, 0xfu);
            let bits = (vec4<u32>(word_at(a + h)) >> (vec4<u32>(0u, 1u, 2u, 3u) + 16u * c + 4u * g)) & vec4<u32>(1u);
            return vec4<f32>(low | (bits << vec4<u32>(4u)));
        }
        case 10u: {
            let v = word_at(a + 16u + 32u * (c / 8u) + 16u * (c % 2u) + 4u * g);
            return vec4<f32>(bytes4(v, 2u * ((c % 8u) / 2u), 3u));
        }
        case 11u: {
            let l = 16u * (c % 2u) + 4u * g;
            let low = bytes4(word_at(a + 32u + 32u * (c / 8u) + l), 2u * ((c % 8u) / 2u), 3u);
            let high = bytes4(word_at(a + l), 4u * (c / 8u) + (c % 8u) / 2u, 1u);
            return vec4<f32>(low | (high << vec4<u32>(2u)));
        }
        case 12u: {
            let s = c / 2u;
            let v = word_at(a + 16u + 32u * (s / 2u) + 16u * (c % 2u) + 4u * g);
            return vec4<f32>(bytes4(v, 4u * (s % 2u), 0xfu));
        }
        case 13u: {
            let s = c / 2u;
            let l = 16u * (c % 2u) + 4u * g;
            let low = bytes4(word_at(a + 48u + 32u * (s / 2u) + l), 4u * (s % 2u), 0xfu);
            let high = bytes4(word_at(a + 16u + l), s, 1u);
            return vec4<f32>(low | (high << vec4<u32>(4u)));
        }
        case 14u: {
            // Half h of the block (128 values), quarter qq of it (32 values), byte l.
            let h = c / 8u;
            let qq = (c % 8u) / 2u;
            let l = 16u * (c % 2u) + 4u * g;
            let low = bytes4(word_at(a + 64u * h + 32u * (qq % 2u) + l), 4u * (qq / 2u), 0xfu);
            let high = bytes4(word_at(a + 128u + 32u * h + l), 2u * qq, 3u);
            return vec4<f32>(low | (high << vec4<u32>(4u)));
        }
        case 20u: {
            return levels4(bytes4(word_at(a + 2u + 4u * g), nib, 0xfu));
        }
        case 23u: {
            return levels4(bytes4(word_at(a + 8u + 16u * (c / 2u) + 4u * g), nib, 0xfu));
        }
        default: {
            return signed4(word_at(a + 2u + 16u * c + 4u * g));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A 32-value unit at once (sub-block s of the block at byte a: chunks 2s and 2s + 1), each
// word the unit needs loaded once: a 2-byte-aligned run of n words costs n + 1 loads (the
// halves funnelled in registers, without a branch), and the scales are read from whole words.

// The unit's quants (before scale and offset, 8 quads: chunk 2s's then chunk 2s + 1's) and
// each chunk's scale and offset (value = scale * q - offset).
struct QUnit {
    q: array<vec4<f32>, 8>,
    s0: vec2<f32>,
    s1: vec2<f32>,
}

// Whether the type has an offset (else the offsets are 0 and sums of x are not needed).
fn has_offset() -> bool {
    switch QTYPE {
        case 8u, 20u, 23u: { return false; }
        default: { return true; }
    }
}

// The 4 bytes from the upper half of lo on (odd) or lo itself.
fn funnel(lo: u32, hi: u32, odd: bool) -> u32 {
    return select(lo, (lo >> 16u) | (hi << 16u), odd);
}

// The 16 bytes at byte b (2-byte aligned), from 5 loads.
fn run4(b: u32) -> array<u32, 4> {
    let i = b >> 2u;
    let odd = (b & 2u) != 0u;
    var r: array<u32, 5>;
    for (var j = 0u; j < 5u; j++) {
        r[j] = w[i + j];
    }
    var o: array<u32, 4>;
    for (var j = 0u; j < 4u; j++) {
        o[j] = funnel(r[j], r[j + 1u], odd);
    }
    return o;
}

// The 32 bytes at byte b (2-byte aligned), from 9 loads.
fn run8(b: u32) -> array<u32, 8> {
    let i = b >> 2u;
    let odd = (b & 2u) != 0u;
    var r: array<u32, 9>;
    for (var j = 0u; j < 9u; j++) {
        r[j] = w[i + j];
    }
    var o: array<u32, 8>;
    for (var j = 0u; j < 8u; j++) {
        o[j] = funnel(r[j], r[j + 1u], odd);
    }
    return o;
}

// The two bytes at byte a (2-byte aligned) as a u32, from one load.
fn u16_at(a: u32) -> u32 {
    return (w[a >> 2u] >> ((a & 2u) * 8u)) & 0xffffu;
}

fn f16_at(a: u32) -> f32 {
    return unpack2x16float(u16_at(a)).x;
}

// Byte i (0..12) of Q4_K's and Q5_K's three scale words.
fn k4_byte(sc: array<u32, 3>, i: u32) -> u32 {
    let v = select(select(sc[0], sc[1], i >= 4u), sc[2], i >= 8u);
    return (v >> (8u * (i % 4u))) & 0xffu;
}

// Q4_K's scale and min of sub-block s from the 12 scale bytes (k4_scale's, from words).
fn k4_scale_words(a: u32, s: u32) -> vec2<f32> {
    let i = a >> 2u;
    let dm = unpack2x16float(w[i]);
    let sc = array<u32, 3>(w[i + 1u], w[i + 2u], w[i + 3u]);
    let lo = k4_byte(sc, s % 4u);
    let hi = k4_byte(sc, s % 4u + 4u);
    let top = k4_byte(sc, s % 4u + 8u);
    let v = select(vec2<u32>(lo & 63u, hi & 63u), vec2<u32>((top & 0xfu) | ((lo >> 6u) << 4u), (top >> 4u) | ((hi >> 6u) << 4u)), s >= 4u);
    return dm * vec2<f32>(v);
}

fn unit_q8_0(a: u32) -> QUnit {
    var u: QUnit;
    let qs = run8(a + 2u);
    for (var g = 0u; g < 8u; g++) {
        u.q[g] = signed4(qs[g]);
    }
    let d = f16_at(a);
    u.s0 = vec2<f32>(d, 0.0);
    u.s1 = u.s0;
    return u;
}

// Q4_0 and IQ4_NL: 16 nibble bytes after d; Q5_0 with the fifth bits between.
fn unit_q4_0(a: u32) -> QUnit {
    var u: QUnit;
    let five = QTYPE == 6u;
    let qs = run4(a + select(2u, 6u, five));
    let qh = funnel(w[(a + 2u) >> 2u], w[((a + 2u) >> 2u) + 1u], (a & 2u) == 0u);
    for (var g = 0u; g < 4u; g++) {
        var lo = bytes4(qs[g], 0u, 0xfu);
        var hi = bytes4(qs[g], 4u, 0xfu);
        if (five) {
            let bit = vec4<u32>(0u, 1u, 2u, 3u) + 4u * g;
            lo |= ((vec4<u32>(qh) >> bit) & vec4<u32>(1u)) << vec4<u32>(4u);
            hi |= ((vec4<u32>(qh) >> (bit + 16u)) & vec4<u32>(1u)) << vec4<u32>(4u);
        }
        if (QTYPE == 20u) {
            u.q[g] = levels4(lo);
            u.q[g + 4u] = levels4(hi);
        } else {
            u.q[g] = vec4<f32>(lo);
            u.q[g + 4u] = vec4<f32>(hi);
        }
    }
    let d = f16_at(a);
    u.s0 = vec2<f32>(d, select(select(8.0, 16.0, five), 0.0, QTYPE == 20u) * d);
    u.s1 = u.s0;
    return u;
}

// Q4_K: sub-block s's 32 nibbles share 32 bytes with its pair (low nibbles: even s).
fn unit_q4_k(a: u32, s: u32) -> QUnit {
    var u: QUnit;
    let qs = run8(a + 16u + 32u * (s / 2u));
    for (var g = 0u; g < 8u; g++) {
        u.q[g] = vec4<f32>(bytes4(qs[g], 4u * (s % 2u), 0xfu));
    }
    u.s0 = k4_scale_words(a, s);
    u.s1 = u.s0;
    return u;
}

// Q6_K: sub-block s is quarter s % 4 of half s / 4 (low nibbles and high bit pairs).
fn unit_q6_k(a: u32, s: u32) -> QUnit {
    var u: QUnit;
    let h = s / 4u;
    let qq = s % 4u;
    let ql = run8(a + 64u * h + 32u * (qq % 2u));
    let qh = run8(a + 128u + 32u * h);
    for (var g = 0u; g < 8u; g++) {
        let low = bytes4(ql[g], 4u * (qq / 2u), 0xfu);
        let high = bytes4(qh[g], 2u * qq, 3u);
        u.q[g] = vec4<f32>(low | (high << vec4<u32>(4u)));
    }
    let sc = u16_at(a + 192u + 8u * h + 2u * qq);
    let d = f16_at(a + 208u);
    let s0 = d * f32(signed_byte(sc & 0xffu));
    let s1 = d * f32(signed_byte(sc >> 8u));
    u.s0 = vec2<f32>(s0, 32.0 * s0);
    u.s1 = vec2<f32>(s1, 32.0 * s1);
    return u;
}

// Any type, through chunk_scale and chunk_quad.
fn unit_any(a: u32, s: u32) -> QUnit {
    var u: QUnit;
    for (var g = 0u; g < 4u; g++) {
        u.q[g] = chunk_quad(a, 2u * s, g);
        u.q[g + 4u] = chunk_quad(a, 2u * s + 1u, g);
    }
    u.s0 = chunk_scale(a, 2u * s);
    u.s1 = chunk_scale(a, 2u * s + 1u);
    return u;
}

// Sub-block s (32 values) of the block at byte a.
fn unit_at(a: u32, s: u32) -> QUnit {
    switch QTYPE {
        case 8u: { return unit_q8_0(a); }
        case 2u, 6u, 20u: { return unit_q4_0(a); }
        case 12u: { return unit_q4_k(a, s); }
        case 14u: { return unit_q6_k(a, s); }
        default: { return unit_any(a, s); }
    }
}

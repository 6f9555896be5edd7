// Decode GEMV on block-quantized weights with packed 4x8 integer dot products (dot4I8Packed),
// in the manner of llama.cpp's q8_1 path: y[m][n] = x[m][k] . dequant(w)[n][k] (+ bias[n]) for
// m <= 8, with the inputs quantized to int8, one f32 scale d per 32 values.
//
// Same bindings and weight layout as matmul_quant.wgsl (quant_blocks.wgsl is appended). Each
// 16-value chunk of a weight row is value = s * q - o (chunk_scale) with q its raw quants, which
// every type keeps within 0..127 (Q8_0's are signed bytes), so the chunk becomes four i8x4
// words. With x ~ d * qx (qx = round(x / d)) and S = d * sum(qx) over the chunk,
//   sum_j w_j x_j ~ s * d * dot(q, qx) - o * S = sum_j w_j * (d * qx_j)
// exactly as in llama.cpp: the only error beyond f32 rounding is the inputs' int8 rounding,
// at most sum_j |w_j| * d / 2.
//
// DP_PARTS = 2 rounds each input in two parts, x ~ d * (qx + qr / 254): qr = round((x - d * qx)
// / (d / 254)) is the residual on a grid 254 times finer, again int8 (|x - d * qx| <= d / 2).
// Each weight word is dotted with both, and the integer sums meet as 254 * dot(q, qx) +
// dot(q, qr) (at most 2^26 for Q8_0's signed bytes, exact in i32), so the error bound becomes
// sum_j |w_j| * d / 508 at twice the integer dot products and one more staging barrier.
//
// The inputs are quantized in workgroup memory, DP_TILE values of each row at a time, by the
// workgroup that uses them: no extra buffer or pass (the op keeps the packed matmul's binding
// layout, so it is one more candidate of the same op), at the cost of every workgroup
// quantizing the whole input, which GV_COLS weight rows per workgroup amortize.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    has_bias: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> p: Params;

// Invocations per workgroup, and weight rows per workgroup (GV_COLS * DP_ROWS <= GV_WG).
override GV_WG: u32 = 64u;
override GV_COLS: u32 = 8u;
// 1: the inputs rounded to int8 once (llama.cpp's q8_1); 2: also their residual.
override DP_PARTS: u32 = 1u;
// Most input rows.
const DP_ROWS: u32 = 8u;
// Input values staged per step, and as i8x4 words.
const DP_TILE: u32 = 512u;
const DP_TW: u32 = DP_TILE / 4u;

// Per word of the tile: the largest |x| of its 4 values (as bits), then, with two parts, the
// packed residuals (one array for both keeps the two-part staging within 16 KiB); and the
// packed int8 values.
var<workgroup> dp_aux: array<u32, DP_ROWS * DP_TW>;
var<workgroup> dp_xq: array<u32, DP_ROWS * DP_TW>;
// Per 32 values the scale d; per 16 the sum of the quantized values, times d.
var<workgroup> dp_xd: array<f32, DP_ROWS * DP_TILE / 32u>;
var<workgroup> dp_xs: array<f32, DP_ROWS * DP_TILE / 16u>;
// Partial sums per input row and invocation (sized for GV_WG <= 128: a fixed size, as naga
// 30's override processing mishandles an override-sized array beside a later override).
var<workgroup> dp_red: array<f32, 128u * DP_ROWS>;

// Byte address of the block holding chunk ci of weight row n, and the chunk's index in it.
fn dp_chunk_at(n: u32, ci: u32) -> vec2<u32> {
    let per_block = block_len() / 16u;
    let row = (p.k / block_len()) * block_bytes();
    return vec2<u32>(n * row + (ci / per_block) * block_bytes(), ci % per_block);
}

// Bit 4 of each byte from 4 bits (a 5-bit type's fifth bits, one per value).
fn spread4(h: u32) -> u32 {
    return ((h & 1u) << 4u) | ((h & 2u) << 11u) | ((h & 4u) << 18u) | ((h & 8u) << 25u);
}

// Chunk c (16 raw quants) of the block at byte a as four i8x4 words, values in order.
fn chunk_words(a: u32, c: u32) -> vec4<u32> {
    var out: vec4<u32>;
    let nib = 0x0f0f0f0fu;
    for (var i = 0u; i < 4u; i++) {
        let o = 4u * i;
        switch QTYPE {
            case 8u: {
                out[i] = word_at(a + 2u + 16u * c + o);
            }
            case 2u, 3u: {
                // Q4_0 / Q4_1: 16 nibble bytes; low nibbles are chunk 0, high chunk 1.
                let qs = a + select(2u, 4u, QTYPE == 3u);
                out[i] = (word_at(qs + o) >> (4u * c)) & nib;
            }
            case 6u, 7u: {
                // Q5_0 / Q5_1: the nibbles, plus bit 16c + j of the 32 fifth bits.
                let qh = a + select(2u, 4u, QTYPE == 7u);
                let lo = (word_at(qh + 4u + o) >> (4u * c)) & nib;
                out[i] = lo | spread4((word_at(qh) >> (16u * c + o)) & 0xfu);
            }
            case 12u: {
                // Q4_K: 64 values per 32 bytes, low nibbles for sub-block s even, high for odd.
                let s = c / 2u;
                out[i] = (word_at(a + 16u + 32u * (s / 2u) + 16u * (c % 2u) + o) >> (4u * (s % 2u))) & nib;
            }
            case 13u: {
                // Q5_K: Q4_K's nibbles after 32 bytes whose bit s is value l's fifth bit.
                let s = c / 2u;
                let l = 16u * (c % 2u) + o;
                let lo = (word_at(a + 48u + 32u * (s / 2u) + l) >> (4u * (s % 2u))) & nib;
                out[i] = lo | (((word_at(a + 16u + l) >> s) & 0x01010101u) << 4u);
            }
            case 14u: {
                // Q6_K: low nibbles (64 bytes per 128 values), high bit pairs (32 bytes).
                let h = c / 8u;
                let r0 = (16u * c) % 128u;
                let qq = r0 / 32u;
                let l = r0 % 32u + o;
                let lo = (word_at(a + 64u * h + 32u * (qq & 1u) + l) >> (4u * (qq / 2u))) & nib;
                let hi = (word_at(a + 128u + 32u * h + l) >> (2u * qq)) & 0x03030303u;
                out[i] = lo | (hi << 4u);
            }
            default: {
                // Q2_K, Q3_K, IQ4_NL, IQ4_XS: byte by byte from the common reader (their
                // quants and levels fit int8 as well).
                var v = 0u;
                for (var b = 0u; b < 4u; b++) {
                    v |= (bitcast<u32>(i32(chunk_q(a, c, o + b))) & 0xffu) << (8u * b);
                }
                out[i] = v;
            }
        }
    }
    return out;
}

fn x4(r: u32, kk: u32) -> vec4<f32> {
    let b = r * p.k + kk;
    return vec4<f32>(x[b], x[b + 1u], x[b + 2u], x[b + 3u]);
}

fn pack_i8x4(q: vec4<i32>) -> u32 {
    return (u32(q.x) & 0xffu) | ((u32(q.y) & 0xffu) << 8u) | ((u32(q.z) & 0xffu) << 16u) | (u32(q.w) << 24u);
}

// The largest |x| of each word's 4 values of the tile into dp_aux, as bits (zero past k).
fn stage_amax(lid: u32, k0: u32, tk: u32) {
    for (var u = lid; u < p.m * DP_TW; u += GV_WG) {
        var a = 0.0;
        if (u % DP_TW < tk / 4u) {
            let v = abs(x4(u / DP_TW, k0 + 4u * (u % DP_TW)));
            a = max(max(v.x, v.y), max(v.z, v.w));
        }
        dp_aux[u] = bitcast<u32>(a);
    }
    workgroupBarrier();
}

// The largest |x| of the 32-value group of word u (its 8 aligned neighbours: DP_TW is a
// multiple of 8), from dp_aux.
fn group_amax(u: u32) -> f32 {
    var a = 0.0;
    for (var i = 0u; i < 8u; i++) {
        a = max(a, bitcast<f32>(dp_aux[8u * (u / 8u) + i]));
    }
    return a;
}

// Per 16 values, the sum of the quantized inputs times their scale: d * sum(qx), or with two
// parts d * (254 * sum(qx) + sum(qr)) / 254.
fn stage_sums(lid: u32) {
    for (var c = lid; c < p.m * DP_TW / 4u; c += GV_WG) {
        var s = 0;
        var sr = 0;
        for (var i = 0u; i < 4u; i++) {
            s += dot4I8Packed(dp_xq[4u * c + i], 0x01010101u);
            if (DP_PARTS == 2u) {
                sr += dot4I8Packed(dp_aux[4u * c + i], 0x01010101u);
            }
        }
        var v = f32(s) * dp_xd[c / 2u];
        if (DP_PARTS == 2u) {
            v = f32(254 * s + sr) * (dp_xd[c / 2u] / 254.0);
        }
        dp_xs[c] = v;
    }
    workgroupBarrier();
}

// Quantizes values k0 .. k0 + tk of every input row into dp_xq, dp_xd and dp_xs (values past
// k are zero), one i8x4 word per invocation and step.
fn quantize_tile(lid: u32, k0: u32, tk: u32) {
    let words = p.m * DP_TW;
    stage_amax(lid, k0, tk);
    for (var u = lid; u < words; u += GV_WG) {
        let d = group_amax(u) / 127.0;
        let inv = select(0.0, 1.0 / d, d > 0.0);
        var q = vec4<i32>(0);
        if (u % DP_TW < tk / 4u) {
            q = clamp(vec4<i32>(round(x4(u / DP_TW, k0 + 4u * (u % DP_TW)) * inv)), vec4<i32>(-127), vec4<i32>(127));
        }
        dp_xq[u] = pack_i8x4(q);
        if (u % 8u == 0u) {
            dp_xd[u / 8u] = d;
        }
    }
    workgroupBarrier();
    stage_sums(lid);
}

// quantize_tile in two parts: the groups' scales first (the residuals then overwrite the
// maxima in dp_aux), then per word qx = round(x / d) into dp_xq and the residual
// qr = round((x - d * qx) * 254 / d) into dp_aux.
fn quantize_tile2(lid: u32, k0: u32, tk: u32) {
    let words = p.m * DP_TW;
    stage_amax(lid, k0, tk);
    for (var g = lid; g < words / 8u; g += GV_WG) {
        dp_xd[g] = group_amax(8u * g) / 127.0;
    }
    workgroupBarrier();
    for (var u = lid; u < words; u += GV_WG) {
        let d = dp_xd[u / 8u];
        let inv = select(0.0, 1.0 / d, d > 0.0);
        var q = vec4<i32>(0);
        var qr = vec4<i32>(0);
        if (u % DP_TW < tk / 4u) {
            let v = x4(u / DP_TW, k0 + 4u * (u % DP_TW));
            q = clamp(vec4<i32>(round(v * inv)), vec4<i32>(-127), vec4<i32>(127));
            let r = v - d * vec4<f32>(q);
            qr = clamp(vec4<i32>(round(r * (254.0 * inv))), vec4<i32>(-127), vec4<i32>(127));
        }
        dp_xq[u] = pack_i8x4(q);
        dp_aux[u] = pack_i8x4(qr);
    }
    workgroupBarrier();
    stage_sums(lid);
}

// A workgroup per GV_COLS weight rows; GV_WG / GV_COLS invocations per row stride over its
// 16-value chunks (neighbours read neighbouring chunks), each applying a chunk to every input
// row; the partial sums meet in workgroup memory.
@compute @workgroup_size(GV_WG)
fn qgemv_dp4(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let n0 = (wid.y * nwg.x + wid.x) * GV_COLS;
    let lanes = GV_WG / GV_COLS;
    let col = lid / lanes;
    let nr = min(n0 + col, p.n - 1u);
    var acc: array<f32, DP_ROWS>;
    for (var k0 = 0u; k0 < p.k; k0 += DP_TILE) {
        let tk = min(DP_TILE, p.k - k0);
        if (DP_PARTS == 2u) {
            quantize_tile2(lid, k0, tk);
        } else {
            quantize_tile(lid, k0, tk);
        }
        for (var ch = lid % lanes; ch < tk / 16u; ch += lanes) {
            let at = dp_chunk_at(nr, k0 / 16u + ch);
            let sc = chunk_scale(at.x, at.y);
            let wq = chunk_words(at.x, at.y);
            for (var r = 0u; r < p.m; r++) {
                let xb = r * DP_TW + 4u * ch;
                var dot = dot4I8Packed(wq.x, dp_xq[xb]) + dot4I8Packed(wq.y, dp_xq[xb + 1u])
                    + dot4I8Packed(wq.z, dp_xq[xb + 2u]) + dot4I8Packed(wq.w, dp_xq[xb + 3u]);
                var d = dp_xd[xb / 8u];
                if (DP_PARTS == 2u) {
                    dot = 254 * dot + dot4I8Packed(wq.x, dp_aux[xb]) + dot4I8Packed(wq.y, dp_aux[xb + 1u])
                        + dot4I8Packed(wq.z, dp_aux[xb + 2u]) + dot4I8Packed(wq.w, dp_aux[xb + 3u]);
                    d /= 254.0;
                }
                acc[r] += sc.x * d * f32(dot) - sc.y * dp_xs[xb / 4u];
            }
        }
        // The next tile overwrites the staged inputs.
        workgroupBarrier();
    }
    for (var r = 0u; r < p.m; r++) {
        dp_red[r * GV_WG + lid] = acc[r];
    }
    workgroupBarrier();
    if (lid < GV_COLS * DP_ROWS) {
        let cc = lid / DP_ROWS;
        let r = lid % DP_ROWS;
        let n = n0 + cc;
        if (r < p.m && n < p.n) {
            var v = 0.0;
            for (var t = 0u; t < lanes; t++) {
                v += dp_red[r * GV_WG + cc * lanes + t];
            }
            if (p.has_bias != 0u) {
                v += bias[n];
            }
            y[r * p.n + n] = v;
        }
    }
}

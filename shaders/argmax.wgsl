// Picking each sequence's next token on the device, so decode reads back token ids instead of
// batch x vocab logits. One workgroup per row of logits.
// logits: [batch][vocab]
// draws:  [batch] uniform random numbers in [0, 1), drawn on the host from the seeded stream
//         (read by `sample` only)
// allow:  [batch][allow_words] u32 bit sets (read only when allow_words > 0): token t of row b
//         may be picked only where bit t % 32 of allow[b * allow_words + t / 32] is set (a
//         structured-output grammar's mask, uploaded per step); the count of non-finite
//         logits still covers every token
// adjust: (read only when p.adjusted != 0) sparse per-row changes to logits before the pick
//         (logit bias and penalties): word 0 = n, the rows that have a range; words 1 ..= n + 1
//         = entry offsets (row b's entries are [adjust[1 + b], adjust[2 + b])); entry e at
//         word n + 2 + 4e = (token, add, repetition, sub), the floats as bits, each row's
//         entries sorted by token. Token t's logit x becomes x + add, then divided by
//         repetition where positive and multiplied by it where not (1: unchanged), then
//         minus sub (+inf bans the token), in the host sampler's order. The count of
//         non-finite logits is of the logits before any change.
// out:    [2][batch] u32: out[b] = the token of row b; out[batch + b] = how many of the row's
//         logits are not finite (NaN or +-inf), so the host can refuse them instead of emitting
//         tokens
// Order of candidates, as the host sampler's: larger logit first, lower id first among equal
// logits; NaN is never a candidate (a row of NaN only picks token 0).
struct Params {
    batch: u32,
    vocab: u32,
    // `sample`: candidates kept (1 ..= MAX_K).
    top_k: u32,
    // `sample`: logits are divided by this before the softmax (> 0).
    temperature: f32,
    // `sample`: keep the most likely candidates whose probabilities first reach this (0, 1].
    top_p: f32,
    // Words of `allow` per row; 0: every token may be picked.
    allow_words: u32,
    // 1: `adjust` applies; 0: it is not read.
    adjusted: u32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read> draws: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;
@group(0) @binding(3) var<storage, read> allow: array<u32>;
@group(0) @binding(4) var<storage, read> adjust: array<u32>;
@group(0) @binding(5) var<uniform> p: Params;

const WG: u32 = 256u;
const MAX_K: u32 = 64u;
// Identifies "no candidate" (an empty slice, or a row of NaN).
const NONE: u32 = 0xffffffffu;

var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;
var<workgroup> bad: array<u32, WG>;
var<workgroup> picked_v: array<f32, MAX_K>;
var<workgroup> picked_i: array<u32, MAX_K>;

fn is_finite(v: f32) -> bool {
    // NaN fails every comparison; +-inf exceeds the largest finite f32.
    return abs(v) <= 3.4028235e38;
}

// Whether candidate (v, i) comes before (w, j) in the order above. NONE never does.
fn before(v: f32, i: u32, w: f32, j: u32) -> bool {
    if (i == NONE) {
        return false;
    }
    if (j == NONE) {
        return true;
    }
    return v > w || (v == w && i < j);
}

// Tree reduction of every invocation's (best_v, best_i) to slot 0, and of `bad` to a sum.
fn reduce(lid: u32) {
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            let v = best_v[lid + stride];
            let i = best_i[lid + stride];
            if (before(v, i, best_v[lid], best_i[lid])) {
                best_v[lid] = v;
                best_i[lid] = i;
            }
            bad[lid] += bad[lid + stride];
        }
        workgroupBarrier();
    }
}

// Whether the row's mask (if any) lets token c be picked.
fn open(row: u32, c: u32) -> bool {
    if (p.allow_words == 0u) {
        return true;
    }
    return ((allow[row * p.allow_words + c / 32u] >> (c % 32u)) & 1u) == 1u;
}

// Logit x of token c of `row` after the row's adjustment of c, if it has one (a binary
// search of the row's entries, sorted by token).
fn adjusted(row: u32, c: u32, x: f32) -> f32 {
    let n = adjust[0];
    if (row >= n) {
        return x;
    }
    let base = n + 2u;
    var lo = adjust[1u + row];
    var hi = adjust[2u + row];
    while (lo < hi) {
        let mid = lo + (hi - lo) / 2u;
        let t = adjust[base + 4u * mid];
        if (t == c) {
            var y = x + bitcast<f32>(adjust[base + 4u * mid + 1u]);
            let r = bitcast<f32>(adjust[base + 4u * mid + 2u]);
            if (r != 1.0) {
                y = select(y * r, y / r, y > 0.0);
            }
            return y - bitcast<f32>(adjust[base + 4u * mid + 3u]);
        }
        if (t < c) {
            lo = mid + 1u;
        } else {
            hi = mid;
        }
    }
    return x;
}

// The best candidate of this invocation's strided share of `row` that comes strictly after
// (after_v, after_i) (NONE: no bound), reduced over the workgroup into slot 0.
fn best_after(row: u32, lid: u32, after_v: f32, after_i: u32, count_bad: bool) {
    let base = row * p.vocab;
    var v = 0.0;
    var i = NONE;
    var n_bad = 0u;
    for (var c = lid; c < p.vocab; c += WG) {
        var x = logits[base + c];
        if (!is_finite(x)) {
            n_bad += 1u;
        }
        if (p.adjusted != 0u) {
            x = adjusted(row, c, x);
        }
        // NaN fails `x == x`: never a candidate.
        let allowed = after_i == NONE || before(after_v, after_i, x, c);
        if (x == x && allowed && open(row, c) && before(x, c, v, i)) {
            v = x;
            i = c;
        }
    }
    best_v[lid] = v;
    best_i[lid] = i;
    bad[lid] = select(0u, n_bad, count_bad);
    workgroupBarrier();
    reduce(lid);
}

@compute @workgroup_size(WG)
fn argmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x;
    if (row >= p.batch) {
        return;
    }
    best_after(row, lid, 0.0, NONE, true);
    if (lid == 0u) {
        out[row] = select(best_i[0], 0u, best_i[0] == NONE);
        out[p.batch + row] = bad[0];
    }
}

// Top-k, then temperature, then top-p (nucleus), then one draw, as the host sampler does:
// the k best candidates are found in k rounds (each the best after the previous one), their
// softmax at the temperature is cut where its cumulative mass first reaches top_p, and the
// row's draw picks within what is left.
@compute @workgroup_size(WG)
fn sample(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x;
    if (row >= p.batch) {
        return;
    }
    let k = clamp(p.top_k, 1u, MAX_K);
    var after_v = 0.0;
    var after_i = NONE;
    var found = 0u;
    var bad_total = 0u;
    for (var r = 0u; r < k; r++) {
        best_after(row, lid, after_v, after_i, r == 0u);
        // Uniform loads: every invocation takes the same branch below, so the barriers of
        // the next round stay in uniform control flow.
        let v = workgroupUniformLoad(&best_v[0]);
        let i = workgroupUniformLoad(&best_i[0]);
        if (r == 0u) {
            bad_total = bad[0];
        }
        // Every invocation reads slot 0 before anyone overwrites it in the next round.
        workgroupBarrier();
        if (i == NONE) {
            break;
        }
        if (lid == 0u) {
            picked_v[r] = v;
            picked_i[r] = i;
        }
        after_v = v;
        after_i = i;
        found = r + 1u;
    }
    if (lid != 0u) {
        return;
    }
    out[p.batch + row] = bad_total;
    if (found == 0u) {
        out[row] = 0u;
        return;
    }
    // Softmax at the temperature, relative to the best logit (1 for the best candidate).
    var probs: array<f32, MAX_K>;
    var total = 0.0;
    for (var r = 0u; r < found; r++) {
        probs[r] = exp((picked_v[r] - picked_v[0]) / p.temperature);
        total += probs[r];
    }
    var keep = found;
    if (p.top_p < 1.0) {
        var cumulative = 0.0;
        for (var r = 0u; r < found; r++) {
            cumulative += probs[r] / total;
            if (cumulative >= p.top_p) {
                keep = r + 1u;
                break;
            }
        }
    }
    var kept = 0.0;
    for (var r = 0u; r < keep; r++) {
        kept += probs[r];
    }
    var u = draws[row] * kept;
    var choice = picked_i[keep - 1u];
    for (var r = 0u; r < keep; r++) {
        if (u < probs[r]) {
            choice = picked_i[r];
            break;
        }
        u -= probs[r];
    }
    out[row] = choice;
}

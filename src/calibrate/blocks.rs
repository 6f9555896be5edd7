//! The model's blocks (attention halves, whole layers) at the run's decode and prefill steps:
//! achieved rate against arithmetic intensity; and the cost of a dispatch and of a submission,
//! measured with the same blocks at their narrowest.

use std::io::Write;
use std::ops::Range;

use crate::device::DType;
use crate::error::Result;
use crate::model::{
    Activations, GpuModel, KvCache, ModelConfig, Placement, ShardSpec, SlidingWindow, Step,
};
use crate::parallel::cost::{self, BlockCost};

use super::median_time;

/// Dispatches a whole layer of the model encodes. Mirrors `model::gpu`: norm, Q/K/V, RoPE
/// (Llama), cache append, attention, output projection, bias (GPT-2) and residual add; then
/// norm, up, gate and SwiGLU (Llama) or GELU, down, bias (GPT-2) and residual add. A sliding
/// layer encodes the same dispatches as a global one.
pub(super) fn dispatches_per_layer(c: &ModelConfig) -> usize {
    // The engines' own counts (`parallel::cost`), so calibration and spans agree.
    let shard = ShardSpec::full(c);
    let step = Step {
        batch: 1,
        seq: 1,
        past: 0,
    };
    let attention = cost::attention(c, &shard, &step, DType::F32).kernels;
    let mlp = cost::mlp(c, &shard, &step, DType::F32).kernels;
    (attention + mlp) as usize
}

/// Work of a model part's layers at one step, charged as the engines charge the spans that
/// hold them: each layer's attention half ([`cost::layer_attention`]: a sliding-window layer
/// over the keys of its window only, as its kernel reads them), and the whole layers
/// ([`cost::total`], MLP halves included), each summed over the part's layers. A measured
/// time divided by it is the achieved rate the projection later applies to those spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StackWork {
    /// Every layer's attention half with its residual add.
    pub(crate) attention: BlockCost,
    /// Every whole layer.
    pub(crate) layers: BlockCost,
}

impl StackWork {
    /// The work of `part`'s layers (of model `c`, f32 weights) at `step`.
    pub(crate) fn of(c: &ModelConfig, part: &Placement, step: &Step) -> Self {
        let layers: Range<usize> = part.layers.clone();
        let mut attention = BlockCost::default();
        for layer in layers.clone() {
            let a = cost::layer_attention(c, &part.shard, step, DType::F32, layer);
            attention.flops += a.flops;
            attention.bytes += a.bytes;
            attention.kernels += a.kernels;
        }
        let layers = cost::total(c, &part.shard, layers, step, DType::F32, false, false);
        Self { attention, layers }
    }

    /// Flops per byte of the whole layers (the sharing curves' key).
    pub(crate) fn layer_intensity(&self) -> f64 {
        self.layers.flops as f64 / self.layers.bytes.max(1) as f64
    }
}

/// `step` as the engines run it: a model with ring-cached sliding layers takes a prompt in
/// chunks ([`crate::parallel::prefill_chunks`]), so its prefill is timed as the prompt's last
/// chunk, the one that attends the most keys.
pub(crate) fn engine_step(step: Step, config: &ModelConfig) -> Step {
    let chunks = crate::parallel::prefill_chunks(config, step.seq);
    let (start, seq) = chunks.last().copied().unwrap_or((0, step.seq));
    Step {
        seq,
        past: step.past + start,
        ..step
    }
}

/// The steps the curves are measured at: decode and prefill with 1, 2, 4, ... sequences, each
/// as the engines run it ([`engine_step`]).
pub(super) fn block_steps(
    batch: usize,
    prompt: usize,
    quick: bool,
    config: &ModelConfig,
) -> Vec<Step> {
    let mut batches: Vec<usize> = std::iter::successors(Some(1usize), |b| Some(b * 2))
        .take_while(|&b| b <= batch)
        .collect();
    if batches.last() != Some(&batch) {
        batches.push(batch);
    }
    if quick {
        batches = vec![1, batch];
        batches.dedup();
    }
    let mut steps = Vec::new();
    for &b in &batches {
        steps.push(Step {
            batch: b,
            seq: 1,
            past: prompt,
        });
        steps.push(Step {
            batch: b,
            seq: prompt,
            past: 0,
        });
    }
    steps.into_iter().map(|s| engine_step(s, config)).collect()
}

/// Widths (hidden sizes) of the narrower blocks measured besides the model's own: a half and
/// a sixth of its width, rounded down to a multiple of 16 (at least 16), each once.
///
/// Why: at equal arithmetic intensity a narrow block runs below a wide one (fewer workgroups
/// per dispatch to fill the device; on a CPU driver, a thread fan-out not paid back), so a
/// rate keyed by intensity alone projects a narrower model too fast. Measuring the model's
/// own block shape at other widths gives the rate its second axis, the block width,
/// without measuring any other model's exact shapes.
pub(super) fn narrow_widths(c: &ModelConfig) -> Vec<usize> {
    let mut widths: Vec<usize> = [2, 6]
        .iter()
        .map(|f| (c.hidden / f / 16 * 16).max(16))
        .filter(|&w| w < c.hidden)
        .collect();
    widths.dedup();
    widths
}

/// Most parameters of the wide synthetic model [`wide_config`] measures: 1 GiB of f32
/// weights, built on the host and uploaded beside the calibrated model. Past it the wide
/// curve is skipped: a model that wide already fills a GPU at its own width, and the widest
/// measured curve holds beyond it.
const WIDE_MAX_PARAMS: usize = 1 << 28;

/// The model's block shape at twice its width, for the rate of models wider than the
/// calibrated one (which would otherwise be held at the calibrated width's rate), with its
/// layers cut so that they hold no more weights than the model's own: a quarter as many, at
/// least one. `None` when no such configuration is valid, or when it would need more than
/// twice the model's parameters (its embedding doubles) or more than [`WIDE_MAX_PARAMS`].
pub(super) fn wide_config(c: &ModelConfig) -> Option<ModelConfig> {
    let wide = config_at_width(c, 2 * c.hidden)?;
    let wide = with_layers(wide, (c.layers / 4).max(1));
    let params = wide.params();
    (params <= 2 * c.params() && params <= WIDE_MAX_PARAMS).then_some(wide)
}

/// The model's block shape at width `hidden`: the same architecture, layer count, head
/// size (halved until it divides the width), ratio of query to key/value heads (as near as
/// the head count allows) and ratio of MLP to hidden width. `None` when no valid
/// configuration has that width.
pub(super) fn config_at_width(c: &ModelConfig, hidden: usize) -> Option<ModelConfig> {
    let mut head_dim = c.head_dim;
    while head_dim > 2 && !hidden.is_multiple_of(head_dim) {
        head_dim /= 2;
    }
    if head_dim == 0 || !hidden.is_multiple_of(head_dim) {
        return None;
    }
    let heads = hidden / head_dim;
    let group = (c.heads / c.kv_heads.max(1)).max(1);
    let kv_heads = (1..=(heads / group).max(1))
        .rev()
        .find(|k| heads.is_multiple_of(*k))
        .unwrap_or(1);
    let ffn = ((c.ffn * hidden / c.hidden).div_ceil(8) * 8).max(8);
    let n = ModelConfig {
        name: format!("{}-width{hidden}", c.name),
        hidden,
        heads,
        kv_heads,
        head_dim,
        ffn,
        ..c.clone()
    };
    n.validate().ok().map(|()| n)
}

/// Layers per submission of the dispatch-cost sweep; the model it runs has the last count.
/// Zero layers is a submission of an empty compute pass: it anchors the fixed cost, which the
/// fit would otherwise extrapolate from 16 dispatches down.
const LAYER_SWEEP: [usize; 6] = [0, 1, 2, 4, 6, 8];

/// Width of the blocks whose dispatches the dispatch cost is measured with: the least a
/// block can be ([`narrow_widths`] rounds to multiples of 16).
const DISPATCH_WIDTH: usize = 16;

/// The model [`dispatch_costs`] runs: `c`'s block shape at [`DISPATCH_WIDTH`] (or `c` itself
/// when no block has that width) with as many layers as the sweep's longest submission.
pub(super) fn dispatch_config(c: &ModelConfig) -> ModelConfig {
    let narrow = config_at_width(c, DISPATCH_WIDTH).unwrap_or_else(|| c.clone());
    with_layers(narrow, LAYER_SWEEP[LAYER_SWEEP.len() - 1])
}

/// `c` with `layers` layers. A model with sliding-window layers keeps its pattern of sliding
/// and global layers, repeated or cut to the new count: its layer flags must match the count
/// for the configuration to be valid, and the measured blocks must slide as the model's do.
pub(super) fn with_layers(c: ModelConfig, layers: usize) -> ModelConfig {
    let sliding = c.sliding.clone().map(|s| {
        let pattern = s.layers.clone();
        SlidingWindow {
            layers: (0..layers)
                .map(|i| pattern.get(i % pattern.len().max(1)) == Some(&true))
                .collect(),
            ..s
        }
    });
    ModelConfig {
        layers,
        sliding,
        ..c
    }
}

/// Host cost of a submission: `t(n) = submit + n x launch` for a submission of `n`
/// dispatches with its wait, fitted by [`dispatch_costs`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct DispatchCosts {
    /// Cost of one more dispatch in a submission, microseconds (`launch_overhead_us`).
    pub(super) launch_us: f64,
    /// Fixed cost of a submission and its wait beyond its dispatches, microseconds
    /// (`submit_overhead_us`).
    pub(super) submit_us: f64,
}

impl DispatchCosts {
    /// Of `t` seconds measured for one submission of `dispatches` dispatches, the part left
    /// for the work itself. The projection adds dispatch costs back per recorded kernel and
    /// the submission's per compute span; a noisy estimate must not leave less than a tenth
    /// of the measured time.
    fn net_s(&self, t: f64, dispatches: f64) -> f64 {
        let fixed_us = dispatches * self.launch_us + self.submit_us;
        (t - fixed_us / 1e6).max(t / 10.0)
    }
}

/// Least-squares fit of `t = fixed + n x per_unit` to `(n, t)` points, weighted by `1 / t^2`
/// (relative error, so the short submissions weigh as much as the long ones).
/// Both coefficients are clamped at 0: a noisy sweep must not give a negative cost. Returns
/// `(fixed, per_unit)`; with fewer than two distinct `n`, all of the time is fixed.
pub(super) fn fit_fixed_per_unit(points: &[(f64, f64)]) -> (f64, f64) {
    let (mut sw, mut sx, mut sy, mut sxx, mut sxy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x, y) in points.iter().filter(|p| p.1.is_finite() && p.1 > 0.0) {
        let w = 1.0 / (y * y);
        sw += w;
        sx += w * x;
        sy += w * y;
        sxx += w * x * x;
        sxy += w * x * y;
    }
    if sw == 0.0 {
        return (0.0, 0.0);
    }
    let det = sw * sxx - sx * sx;
    if det.abs() <= f64::EPSILON * sw * sxx {
        return (sy / sw, 0.0);
    }
    let per = ((sw * sxy - sx * sy) / det).max(0.0);
    let fixed = ((sy - per * sx) / sw).max(0.0);
    (fixed, per)
}

/// Measures [`DispatchCosts`] with the model's own kernels doing the least work they can:
/// `m` (the model of [`dispatch_config`])
/// on one token, submissions of its first 0 to 8 layers in one compute pass, as the engines
/// run theirs, each with its wait; `t(n) = submit + n x dispatches per layer x launch`.
///
/// Why not a sweep of one small element-wise kernel: on a CPU driver a dispatch's cost
/// depends on how the driver spreads its workgroups over threads, and the model's chain of
/// small dependent kernels paid less than half of what a sweep of 16-workgroup adds fitted
/// (30 against 65 us per dispatch, 2026-12-02); the excess made tiny decode steps project slow
/// and, taken off the measured blocks, their rates fast. The launch figure includes the
/// little work of a 16-wide kernel on one token.
pub(super) fn dispatch_costs(
    m: &GpuModel,
    iters: usize,
    log: &mut dyn Write,
) -> Result<DispatchCosts> {
    let step = Step {
        batch: 1,
        seq: 1,
        past: 0,
    };
    let (act, kv) = step_buffers(m, &step)?;
    let per_layer = dispatches_per_layer(m.config()) as f64;
    let gpu = m.gpu();
    let mut points = Vec::with_capacity(LAYER_SWEEP.len());
    for layers in LAYER_SWEEP.into_iter().filter(|&n| n <= m.num_layers()) {
        let t = median_time(iters, || {
            let mut e = gpu.encoder();
            m.layer_range(&mut e, 0..layers, &act, &kv)?;
            gpu.submit(e);
            gpu.wait()
        })?;
        points.push((layers as f64 * per_layer, t * 1e6));
    }
    say_part!(
        log,
        "  submissions of n dispatches ({} wide layers, {per_layer} dispatches each), us:",
        m.config().hidden
    );
    for (n, t) in &points {
        say_part!(log, " {n}: {t:.0}");
    }
    say!(log);
    let (submit_us, launch_us) = fit_fixed_per_unit(&points);
    Ok(DispatchCosts {
        launch_us,
        submit_us,
    })
}

/// One measured block: intensity (flops per byte), work per dispatch (MFLOP) and achieved
/// GFLOP/s net of dispatch cost.
#[derive(Debug, Clone, Copy)]
pub(super) struct Point {
    intensity: f64,
    mflop_per_dispatch: f64,
    gflops: f64,
}

/// Buffers for running `step` on a model: activations, a KV cache and token ids written.
pub(crate) fn step_buffers(m: &GpuModel, step: &Step) -> Result<(Activations, KvCache)> {
    let mut act = m.activations(step.tokens(), step.batch)?;
    let mut kv = m.kv_cache(step.batch)?;
    let vocab = m.config().vocab as u32;
    let ids: Vec<u32> = (0..step.tokens() as u32)
        .map(|i| i * 7919 % vocab)
        .collect();
    m.write_ids(&act, &ids)?;
    m.begin_step(&mut act, &mut kv, step, &step.rows())?;
    Ok((act, kv))
}

/// Every layer's blocks of the step `act` is set up for ([`step_buffers`]) in one submit,
/// like the single and pipeline engines, and a wait; `whole` = attention and MLP halves, else
/// attention halves only.
pub(crate) fn run_blocks(m: &GpuModel, act: &Activations, kv: &KvCache, whole: bool) -> Result<()> {
    let gpu = m.gpu();
    let mut e = gpu.encoder();
    if whole {
        m.layers(&mut e, act, kv)?;
    } else {
        for i in 0..m.num_layers() {
            m.attention(&mut e, i, act, kv)?;
            m.attention_residual(&mut e, i, act)?;
        }
    }
    gpu.submit(e);
    gpu.wait()
}

/// Median time of [`run_blocks`], seconds.
pub(crate) fn time_blocks(m: &GpuModel, step: &Step, whole: bool, iters: usize) -> Result<f64> {
    let (act, kv) = step_buffers(m, step)?;
    median_time(iters, || run_blocks(m, &act, &kv, whole))
}

/// The blocks measured at each step: achieved rates of the attention halves and of whole
/// layers, and the time of the whole layers alone (seconds), which the sharing measurement
/// compares against.
pub(super) struct BlockCurves {
    pub(super) attention: Vec<Point>,
    pub(super) layers: Vec<Point>,
    pub(super) alone_s: Vec<(Step, f64)>,
}

/// Achieved rate of the model's blocks at each step: the work [`StackWork`] charges them
/// (sliding-window layers their window's keys) over the measured time net of dispatch costs.
pub(super) fn block_curves(
    m: &GpuModel,
    steps: &[Step],
    dispatch: DispatchCosts,
    iters: usize,
    log: &mut dyn Write,
) -> Result<BlockCurves> {
    let (mut attn, mut whole, mut alone_s) = (Vec::new(), Vec::new(), Vec::new());
    say!(
        log,
        "  model blocks ({} layers, one submit), net of {:.1} us per dispatch and {:.1} us per submit:",
        m.num_layers(),
        dispatch.launch_us,
        dispatch.submit_us
    );
    say!(
        log,
        "    {:<22} {:>10} {:>10} {:>9} {:>10} {:>10} {:>9}",
        "step",
        "attn ms",
        "flop/B",
        "GFLOP/s",
        "layer ms",
        "flop/B",
        "GFLOP/s"
    );
    for step in steps {
        let work = StackWork::of(m.config(), m.placement(), step);
        let mut row = Vec::new();
        for (whole_layer, w) in [(false, work.attention), (true, work.layers)] {
            let t = time_blocks(m, step, whole_layer, iters)?;
            let p = block_point(w, dispatch.net_s(t, f64::from(w.kernels)));
            row.push((t, p));
            if whole_layer {
                whole.push(p);
                alone_s.push((*step, t));
            } else {
                attn.push(p)
            }
        }
        let kind = if step.seq == 1 { "decode" } else { "prefill" };
        say!(
            log,
            "    {:<22} {:>10.3} {:>10.2} {:>9.2} {:>10.3} {:>10.2} {:>9.2}",
            format!("{kind} {}x{} (+{})", step.batch, step.seq, step.past),
            row[0].0 * 1e3,
            row[0].1.intensity,
            row[0].1.gflops,
            row[1].0 * 1e3,
            row[1].1.intensity,
            row[1].1.gflops
        );
    }
    Ok(BlockCurves {
        attention: attn,
        layers: whole,
        alone_s,
    })
}

/// The point of blocks that did `work` in `net_s` seconds (net of dispatch costs).
fn block_point(work: BlockCost, net_s: f64) -> Point {
    let flops = work.flops as f64;
    Point {
        intensity: flops / work.bytes.max(1) as f64,
        mflop_per_dispatch: flops / f64::from(work.kernels.max(1)) / 1e6,
        gflops: flops / net_s / 1e9,
    }
}

/// Achieved rate of the model's final norm and LM head (with its token pick), one point per
/// batch size of `steps`: each alone in a submission of its own, net of that submission and
/// of the dispatches a span's head part is charged ([`cost::head`]'s count), as the
/// projection adds those back. Points `[flops per byte, GFLOP/s]` ([`curve`]). Empty for an
/// encoder, which has no head.
pub(super) fn head_curve(
    m: &GpuModel,
    steps: &[Step],
    dispatch: DispatchCosts,
    iters: usize,
    log: &mut dyn Write,
) -> Result<Vec<[f64; 2]>> {
    let c = m.config();
    if c.is_encoder() {
        return Ok(Vec::new());
    }
    let mut batches: Vec<usize> = steps.iter().map(|s| s.batch).collect();
    batches.sort_unstable();
    batches.dedup();
    say!(
        log,
        "  final norm and LM head ({} x {}, one submit each), net of the same dispatch costs:",
        c.vocab,
        c.hidden
    );
    say!(
        log,
        "    {:<10} {:>10} {:>10} {:>9}",
        "sequences",
        "ms",
        "flop/B",
        "GFLOP/s"
    );
    let gpu = m.gpu();
    let mut points = Vec::with_capacity(batches.len());
    for batch in batches {
        // The head reads each sequence's last row: a decode step's rows are exactly those.
        let step = Step {
            batch,
            seq: 1,
            past: 0,
        };
        let (act, _kv) = step_buffers(m, &step)?;
        let t = median_time(iters, || {
            let mut e = gpu.encoder();
            m.head(&mut e, &act)?;
            gpu.submit(e);
            gpu.wait()
        })?;
        let work = cost::head(c, batch, DType::F32);
        let p = block_point(work, dispatch.net_s(t, f64::from(work.kernels)));
        say!(
            log,
            "    {:<10} {:>10.3} {:>10.2} {:>9.2}",
            batch,
            t * 1e3,
            p.intensity,
            p.gflops
        );
        points.push(p);
    }
    Ok(curve(points))
}

/// Curve points sorted by intensity; points closer than 2 % in intensity are averaged so the
/// intensities strictly increase.
pub(super) fn curve(points: Vec<Point>) -> Vec<[f64; 2]> {
    surface_curve(points)
        .into_iter()
        .map(|[i, _, g]| [i, g])
        .collect()
}

/// Like [`curve`], keeping each point's work per dispatch: one curve of a rate surface
/// (`[flops per byte, MFLOP per dispatch, GFLOP/s]`).
pub(super) fn surface_curve(mut points: Vec<Point>) -> Vec<[f64; 3]> {
    points.sort_by(|a, b| a.intensity.total_cmp(&b.intensity));
    let mut out: Vec<([f64; 3], f64)> = Vec::new();
    for p in points {
        match out.last_mut() {
            Some((sum, n)) if p.intensity <= sum[0] / *n * 1.02 => {
                sum[0] += p.intensity;
                sum[1] += p.mflop_per_dispatch;
                sum[2] += p.gflops;
                *n += 1.0;
            }
            _ => out.push(([p.intensity, p.mflop_per_dispatch, p.gflops], 1.0)),
        }
    }
    out.into_iter()
        .map(|(s, n)| [s[0] / n, s[1] / n, s[2] / n])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrow_blocks_keep_the_shape_at_a_half_and_a_sixth_of_the_width() {
        let c = ModelConfig::default_model();
        // 384 / 2 and 384 / 6; not 96, the width of the tiny presets the out-of-sample
        // benchmark projects (they must stay out of sample).
        assert_eq!(narrow_widths(&c), vec![192, 64]);
        let half = config_at_width(&c, 192).unwrap();
        assert_eq!(
            (
                half.heads,
                half.kv_heads,
                half.head_dim,
                half.ffn,
                half.layers
            ),
            (6, 2, 32, 512, c.layers)
        );
        assert_eq!(half.arch, c.arch);
        let sixth = config_at_width(&c, 64).unwrap();
        // 1024 x 64 / 384 = 170.7, rounded up to a multiple of 8.
        assert_eq!(
            (sixth.heads, sixth.kv_heads, sixth.head_dim, sixth.ffn),
            (2, 1, 32, 176)
        );
        // A width the head size does not divide halves the head size.
        let odd = config_at_width(&c, 48).unwrap();
        assert_eq!((odd.heads, odd.head_dim), (3, 16));
        // The narrowest model keeps at least one 16-wide width below its own.
        let tiny = ModelConfig::preset("tiny-llama").unwrap();
        assert_eq!(narrow_widths(&tiny), vec![48, 16]);
        for w in narrow_widths(&tiny) {
            assert!(config_at_width(&tiny, w).is_some(), "{w}");
        }
    }

    #[test]
    fn the_wide_block_doubles_the_width_with_a_quarter_of_the_layers() {
        let c = ModelConfig::default_model();
        let wide = wide_config(&c).unwrap();
        assert_eq!(
            (
                wide.hidden,
                wide.heads,
                wide.kv_heads,
                wide.head_dim,
                wide.ffn,
                wide.layers
            ),
            (768, 24, 8, 32, 2048, 1)
        );
        assert!(wide.params() <= 2 * c.params());
        let gpt2 = ModelConfig::preset("gpt2-small").unwrap();
        let wide = wide_config(&gpt2).unwrap();
        assert_eq!((wide.hidden, wide.ffn, wide.layers), (1536, 6144, 3));
        assert_eq!(wide.arch, gpt2.arch);
        // A one-layer model keeps its one layer, which at twice the width holds four times
        // the weights: with the doubled embedding, more than twice the model's parameters.
        let one_layer = ModelConfig {
            layers: 1,
            ..c.clone()
        };
        assert_eq!(wide_config(&one_layer), None);
        // Nor is a model whose widened blocks would take more than 1 GiB of f32 weights:
        // Llama 3 8B at 8192 wide (8 layers) would hold about 9 billion.
        let big = ModelConfig::preset("llama-8b").unwrap();
        assert!(config_at_width(&big, 2 * big.hidden).is_some());
        assert_eq!(wide_config(&big), None);
        assert!(wide_config(&gpt2).unwrap().params() <= WIDE_MAX_PARAMS);
    }

    #[test]
    fn the_dispatch_sweep_model_is_the_narrowest_block_with_every_swept_layer() {
        for name in ["default", "tiny-gpt2", "gpt2-small"] {
            let c = ModelConfig::preset(name).unwrap();
            let d = dispatch_config(&c);
            assert_eq!(d.hidden, DISPATCH_WIDTH, "{name}");
            assert_eq!(d.arch, c.arch, "{name}");
            assert!(LAYER_SWEEP.iter().all(|&n| n <= d.layers), "{name}");
            d.validate().unwrap();
        }
    }

    /// Keys a sequence's queries at `past..past + seq` attend, counted position by position.
    fn keys_counted(past: usize, seq: usize, window: Option<usize>) -> u64 {
        (past..past + seq)
            .map(|p| window.map_or(p + 1, |w| (p + 1).min(w)) as u64)
            .sum()
    }

    /// Issue 37: the work a measured time is divided by charges a sliding-window layer the
    /// keys of its window: past the window, by exactly the keys it skips on each sliding
    /// layer (4 flops per query width and 2 f32 key/value reads per key/value width, per key);
    /// within it, the same as without windows.
    #[test]
    fn sliding_layers_are_charged_their_window_in_the_calibrated_work() {
        let g = ModelConfig::preset("tiny-gemma3").unwrap();
        let off = ModelConfig {
            sliding: None,
            ..g.clone()
        };
        let s = g.sliding.clone().unwrap();
        let sliding = s.layers.iter().filter(|&&on| on).count() as u64;
        assert!(sliding > 0 && sliding < g.layers as u64, "{:?}", s.layers);
        let (q, kv) = (
            (g.heads * g.head_dim) as u64,
            (g.kv_heads * g.head_dim) as u64,
        );
        let (mut past_window, mut within) = (0, 0);
        for (batch, seq, past) in [(2, 1, 20), (3, 20, 0), (1, 7, 9), (2, 1, 2), (3, 5, 0)] {
            let step = Step { batch, seq, past };
            let of = |c: &ModelConfig| StackWork::of(c, &Placement::whole(c), &step);
            let (windowed, whole) = (of(&g), of(&off));
            let skipped = batch as u64
                * (keys_counted(past, seq, None) - keys_counted(past, seq, Some(s.window)));
            let name = format!("{batch}x{seq} (+{past})");
            for (a, b) in [
                (windowed.attention, whole.attention),
                (windowed.layers, whole.layers),
            ] {
                assert_eq!(b.flops - a.flops, sliding * skipped * 4 * q, "{name}");
                assert_eq!(b.bytes - a.bytes, sliding * skipped * 2 * kv * 4, "{name}");
                assert_eq!(a.kernels, b.kernels, "{name}");
            }
            if past + seq > s.window {
                assert!(skipped > 0, "{name}");
                assert!(
                    windowed.layer_intensity() != whole.layer_intensity(),
                    "{name}"
                );
                past_window += 1;
            } else {
                assert_eq!(windowed, whole, "{name}");
                within += 1;
            }
        }
        assert_eq!((past_window, within), (3, 2));
    }

    /// The narrow and wide models a Gemma-like calibration measures keep its sliding layers,
    /// their pattern repeated or cut to their own layer count, and stay valid.
    #[test]
    fn measured_models_of_other_depths_keep_the_sliding_pattern() {
        let g = ModelConfig::preset("tiny-gemma3").unwrap();
        let flags = |c: &ModelConfig| c.sliding.as_ref().unwrap().layers.clone();
        assert_eq!(flags(&g), [true, true, false]);
        let eight = with_layers(g.clone(), 8);
        assert_eq!(
            flags(&eight),
            [true, true, false, true, true, false, true, true]
        );
        eight.validate().unwrap();
        // Its dispatch sweep model (its own width: no 16-wide block keeps its head shape).
        let d = dispatch_config(&g);
        assert_eq!(flags(&d).len(), LAYER_SWEEP[LAYER_SWEEP.len() - 1]);
        d.validate().unwrap();
        let one = with_layers(g.clone(), 1);
        assert_eq!((one.layers, flags(&one)), (1, vec![true]));
        one.validate().unwrap();
        let big = ModelConfig::gemma3_1b();
        let cut = with_layers(big.clone(), (big.layers / 4).max(1));
        assert_eq!(flags(&cut), [true, true, true, true, true, false]);
        cut.validate().unwrap();
        // A model without windows stays without.
        let plain = with_layers(ModelConfig::default_model(), 3);
        assert_eq!((plain.layers, plain.sliding), (3, None));
    }

    #[test]
    fn fixed_and_per_unit_costs_are_recovered() {
        let pts: Vec<(f64, f64)> = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
            .iter()
            .map(|&n| (n, 180.0 + 37.5 * n))
            .collect();
        let (fixed, per) = fit_fixed_per_unit(&pts);
        assert!((fixed - 180.0).abs() < 1e-6, "{fixed}");
        assert!((per - 37.5).abs() < 1e-9, "{per}");
    }

    #[test]
    fn noisy_sweeps_never_give_negative_costs() {
        // Time falling with the dispatch count (a machine that got quieter mid-sweep).
        let (fixed, per) = fit_fixed_per_unit(&[(1.0, 500.0), (64.0, 400.0)]);
        assert_eq!(per, 0.0);
        assert!(fixed > 0.0);
        // A huge fixed part with a steep slope would put the intercept below zero.
        let (fixed, per) = fit_fixed_per_unit(&[(1.0, 10.0), (2.0, 200.0), (64.0, 13_000.0)]);
        assert!(fixed >= 0.0 && per > 0.0);
        assert_eq!(fit_fixed_per_unit(&[]), (0.0, 0.0));
        assert_eq!(fit_fixed_per_unit(&[(4.0, 100.0), (4.0, 300.0)]).1, 0.0);
    }
}

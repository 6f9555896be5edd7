//! The prefill GEMMs on packed weights beside the dense f16 matmuls, in one process on one
//! adapter, interleaved, so the ratios are measured back to back: for each type and `MxNxK`
//! shape, every GEMM variant of the type and every dense f16 prefill variant, then the best
//! packed time as a fraction of the best dense one (the figures of docs/BENCHMARKS.md,
//! "Prefill on packed weights").
//!
//! Each kernel is dispatched `REPS` times per sample in one submission, `ROUNDS` samples in
//! turn with the others; its figure is its fastest sample. Beside the wall time, the process's
//! CPU time per dispatch: on a CPU driver (lavapipe) that is the work the kernel costs,
//! whatever else loads the machine.
//!
//! `cargo run --release --example qgemm_bench -- [TYPES] [SHAPES] [DENSE]`, e.g.
//! `-- q8_0,q4_k 64x576x576,64x576x1536 matmul_vec4,gemm_r8x8_64x64` (defaults: q8_0 at
//! 64x576x576 and 64x1536x576, every dense f16 candidate).

use std::time::Instant;

use wgpar::device::{open_devices, Adapters, DType, DeviceSelection, Gpu, GpuOptions, Tensor};
use wgpar::error::Result;
use wgpar::kernels::ops::{Bound, Matmul, MatmulIo, MatmulKernel, Params, Pass};
use wgpar::kernels::quant::{PackedMatrix, QuantIo, QuantMatmul, GEMV_MAX_ROWS, QUANT_VARIANTS};
use wgpar::kernels::variants::MATMUL;
use wgpar::model::quant::{quantize, QuantType};

type Shape = (usize, usize, usize);

const ROUNDS: usize = 5;
const REPS: usize = 4;

fn parse_shape(s: &str) -> std::result::Result<Shape, String> {
    let d: Vec<usize> = (s.split('x'))
        .map(|v| v.parse().map_err(|_| format!("bad shape {s} (want MxNxK)")))
        .collect::<std::result::Result<_, _>>()?;
    match d[..] {
        [m, n, k] if m > GEMV_MAX_ROWS && n > 0 && k > 0 => Ok((m, n, k)),
        _ => Err(format!("bad shape {s}: MxNxK with M > {GEMV_MAX_ROWS}")),
    }
}

/// Types, shapes, and the dense variants to time (empty: every candidate).
type Args = (Vec<QuantType>, Vec<Shape>, Vec<String>);

fn parse_args() -> std::result::Result<Args, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let types = args.first().map_or("q8_0", |s| s.as_str());
    let shapes = args.get(1).map_or("64x576x576,64x1536x576", |s| s.as_str());
    let types = (types.split(','))
        .map(|t| QuantType::parse(t).ok_or_else(|| format!("unknown type {t}")))
        .collect::<std::result::Result<_, _>>()?;
    let shapes = shapes
        .split(',')
        .map(parse_shape)
        .collect::<std::result::Result<_, _>>()?;
    let dense = args
        .get(2)
        .map(|s| s.split(',').map(String::from).collect());
    Ok((types, shapes, dense.unwrap_or_default()))
}

/// The process's user + system CPU seconds so far.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes the struct it is given and nothing else.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// One kernel under test: its name and its bound, configured op.
struct Timed {
    name: String,
    op: Box<dyn AsRef<Bound>>,
    _params: Params,
    /// Fastest (wall, CPU) seconds per dispatch so far.
    best: (f64, f64),
}

impl Timed {
    fn sample(&mut self, gpu: &Gpu) -> Result<()> {
        let mut enc = gpu.encoder();
        {
            let mut pass = Pass::new(&mut enc);
            for _ in 0..REPS {
                pass.run(&self.op.as_ref())?;
            }
        }
        let (wall, cpu) = (Instant::now(), cpu_seconds());
        gpu.submit(enc);
        gpu.wait()?;
        let per = |s: f64| s / REPS as f64;
        let (w, c) = (per(wall.elapsed().as_secs_f64()), per(cpu_seconds() - cpu));
        self.best = (self.best.0.min(w), self.best.1.min(c));
        Ok(())
    }
}

struct Operands {
    x: Tensor,
    packed: PackedMatrix,
    dense: Tensor,
    y: Tensor,
}

fn operands(gpu: &Gpu, t: QuantType, (m, n, k): Shape) -> Result<Operands> {
    let w: Vec<f32> = (0..n * k)
        .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let x: Vec<f32> = (0..m * k)
        .map(|i| ((i * 104729) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    Ok(Operands {
        x: gpu.upload_f32("bench.x", &x)?,
        packed: PackedMatrix::upload(gpu, "bench.qw", t, &quantize(t, &w), (n, k))?,
        dense: gpu.upload_weights("bench.w", &w, DType::F16)?,
        y: gpu.empty("bench.y", DType::F32, m * n)?,
    })
}

/// Every packed GEMM of `t` and every dense f16 prefill candidate that applies, bound.
fn kernels(
    gpu: &Gpu,
    (t, (m, n, k)): (QuantType, Shape),
    o: &Operands,
    dense_names: &[String],
) -> Result<Vec<Timed>> {
    let mut out = Vec::new();
    for v in QUANT_VARIANTS
        .iter()
        .filter(|v| v.qtype == t && !v.is_gemv())
    {
        let mut params = Params::new(gpu, "bench.quant", 1)?;
        let io = QuantIo {
            x: &o.x,
            w: &o.packed,
            bias: None,
            y: &o.y,
        };
        let mut op = QuantMatmul::bind(gpu, &mut params, io, m)?.with_variant(v.name)?;
        op.configure(gpu, &mut params, m)?;
        params.flush(gpu);
        let (name, op) = (v.name.to_string(), Box::new(op) as Box<dyn AsRef<Bound>>);
        out.push((name, op, params));
    }
    let dense = (MATMUL.iter())
        .filter(|v| v.candidate && v.applies(gpu, (m, n, k)))
        .filter(|v| dense_names.is_empty() || dense_names.iter().any(|d| d == v.name));
    for v in dense {
        let mut params = Params::new(gpu, "bench.dense", 1)?;
        let io = MatmulIo {
            x: &o.x,
            w: &o.dense,
            bias: None,
            y: &o.y,
        };
        let op = Matmul::bind(gpu, &mut params, io, (m, n, k))?;
        let mut op = op.with_kernel(MatmulKernel::Variant(v.name));
        op.configure(gpu, &mut params, m)?;
        params.flush(gpu);
        out.push((format!("f16 {}", v.name), Box::new(op), params));
    }
    Ok((out.into_iter())
        .map(|(name, op, params)| Timed {
            name,
            op,
            _params: params,
            best: (f64::INFINITY, f64::INFINITY),
        })
        .collect())
}

fn bench(gpu: &Gpu, t: QuantType, (m, n, k): Shape, dense_names: &[String]) -> Result<()> {
    if t.row_bytes(k).is_none() {
        println!("{} {m}x{n}x{k}: k is not whole blocks", t.name());
        return Ok(());
    }
    let o = operands(gpu, t, (m, n, k))?;
    let mut all = kernels(gpu, (t, (m, n, k)), &o, dense_names)?;
    for round in 0..=ROUNDS {
        for kernel in &mut all {
            kernel.sample(gpu)?;
            // The first round compiles and warms up; it is not kept.
            if round == 0 {
                kernel.best = (f64::INFINITY, f64::INFINITY);
            }
        }
    }
    let flops = 2.0 * (m * n * k) as f64;
    for kernel in &all {
        let (w, c) = kernel.best;
        let rate = flops / w / 1e9;
        println!(
            "{:26} {m}x{n}x{k}  wall {:8.3} ms {rate:6.2} GFLOP/s  cpu {:8.3} ms",
            kernel.name,
            w * 1e3,
            c * 1e3
        );
    }
    let best = |dense: bool, pick: fn(&(f64, f64)) -> f64| {
        (all.iter())
            .filter(|k| k.name.starts_with("f16 ") == dense)
            .map(|k| pick(&k.best))
            .fold(f64::INFINITY, f64::min)
    };
    println!(
        "{} {m}x{n}x{k}: best packed / best dense f16 speed: wall {:.2}x, cpu {:.2}x",
        t.name(),
        best(true, |b| b.0) / best(false, |b| b.0),
        best(true, |b| b.1) / best(false, |b| b.1),
    );
    Ok(())
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let (types, shapes, dense) = parse_args()?;
    let adapters = Adapters::discover()?;
    let selection = DeviceSelection::Virtual {
        adapter: adapters.preferred(),
        count: 1,
    };
    let gpu = open_devices(&adapters, &selection, &GpuOptions::default())?.remove(0);
    println!("# {}", gpu.describe());
    for t in types {
        for &shape in &shapes {
            bench(&gpu, t, shape, &dense)?;
        }
    }
    Ok(())
}

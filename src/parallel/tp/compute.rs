//! Where a rank computes: its layers, each as two halves (attention, MLP) whose partial sums
//! the group all-reduces before the residual, then the tail (the head on the rank that holds
//! it, the last residual elsewhere).

use std::sync::Arc;
use std::time::Instant;

use super::collective::RankLink;
use super::group::GroupInput;
use super::pass::{HostTime, Pass};
use crate::device::{Gpu, SpanTimer, Tensor};
use crate::error::Result;
use crate::model::{Activations, GpuModel, KvCache, Step};
use crate::parallel::cost;
use crate::trace::{KernelFamily, SpanAttrs, SpanId};

/// Whether the model's part picks tokens: it holds the head of a decoder.
pub(super) fn picks(m: &GpuModel) -> bool {
    m.placement().head && !m.config().is_encoder()
}

/// What a step computes with on a rank.
pub(super) struct Compute<'a> {
    pub(super) model: &'a GpuModel,
    pub(super) gpu: &'a Arc<Gpu>,
    pub(super) timer: &'a SpanTimer,
    pub(super) act: &'a Activations,
    pub(super) kv: &'a KvCache,
}

/// A half of a layer: each ends in a row-parallel projection whose output is a partial sum.
#[derive(Clone, Copy)]
enum Half {
    Attention,
    Mlp,
}

impl Half {
    /// The half's span: its name, kernel family and cost on this rank's shard.
    fn attrs(self, m: &GpuModel, step: &Step, dev: u32, layer: u32) -> SpanAttrs {
        let (config, shard, dtype) = (m.config(), &m.placement().shard, m.weight_dtype());
        let (cost, name, family) = match self {
            Half::Attention => (
                cost::layer_attention(config, shard, step, dtype, layer as usize),
                "attention",
                KernelFamily::Attention,
            ),
            Half::Mlp => (
                cost::mlp(config, shard, step, dtype),
                "mlp",
                KernelFamily::Matmul,
            ),
        };
        SpanAttrs::compute(name, dev)
            .layer(layer)
            .flops(cost.flops)
            .bytes(cost.bytes)
            .kernels(cost.kernels)
            .family(family)
            .blocks_of(config.hidden, shard.world)
    }

    /// The partial sum the half leaves for the all-reduce.
    fn partial(self, act: &Activations) -> &Tensor {
        match self {
            Half::Attention => act.attn_out(),
            Half::Mlp => act.mlp_out(),
        }
    }
}

impl Compute<'_> {
    /// Encodes the embedding (where the group takes token ids) and every layer: each half is
    /// submitted and waited for, all-reduced over `link`, and its residual encoded into the
    /// next submission. Returns that open encoder and when its host work began.
    pub(super) fn layers(
        &self,
        link: &mut RankLink,
        pass: &mut Pass,
    ) -> Result<(wgpu::CommandEncoder, HostTime)> {
        let (m, act) = (self.model, self.act);
        let mut host = HostTime::now();
        let mut enc = self.gpu.encoder();
        self.timer.begin(&mut enc);
        if matches!(pass.job.input, GroupInput::Ids(_)) {
            m.embed(&mut enc, act)?;
        }
        for i in 0..m.num_layers() {
            let layer = (m.placement().layers.start + i) as u32;
            for half in [Half::Attention, Half::Mlp] {
                match half {
                    Half::Attention => m.attention(&mut enc, i, act, self.kv)?,
                    Half::Mlp => m.mlp(&mut enc, i, act)?,
                }
                let compute = self.submit_half(&mut enc, host, (half, layer), pass)?;
                link.all_reduce(self.gpu, half.partial(act), (layer, compute), pass)?;
                host = HostTime::now();
                match half {
                    Half::Attention => m.attention_residual(&mut enc, i, act)?,
                    Half::Mlp => m.mlp_residual(&mut enc, i, act)?,
                }
            }
        }
        Ok((enc, host))
    }

    /// Submits the half layer encoded since `host` and waits for it; records its compute
    /// span. The next span's work goes into a fresh encoder.
    fn submit_half(
        &self,
        enc: &mut wgpu::CommandEncoder,
        host: HostTime,
        (half, layer): (Half, u32),
        pass: &mut Pass,
    ) -> Result<SpanId> {
        let (gpu, timer) = (self.gpu, self.timer);
        timer.end(enc);
        gpu.submit(std::mem::replace(enc, gpu.encoder()));
        pass.add_host(host);
        gpu.wait()?;
        let end = Instant::now();
        let device_us = timer.read_us(gpu)?;
        timer.begin(enc);
        let (m, step, dev) = (self.model, pass.job.step, pass.dev);
        Ok(pass.computed(host.start, end, || {
            half.attrs(m, &step, dev, layer).device_us(device_us)
        }))
    }

    /// The step's tail: the final norm and head where the rank holds them (with the picks
    /// copied out), else the last residual; submitted, waited for and recorded.
    pub(super) fn tail(
        &self,
        mut enc: wgpu::CommandEncoder,
        host: HostTime,
        pass: &mut Pass,
    ) -> Result<()> {
        let (m, gpu, act) = (self.model, self.gpu, self.act);
        if m.placement().head {
            m.finish(&mut enc, act)?;
        }
        self.timer.end(&mut enc);
        if picks(m) {
            m.copy_out(&mut enc, act)?;
        }
        gpu.submit(enc);
        pass.add_host(host);
        gpu.wait()?;
        let end = Instant::now();
        let device_us = self.timer.read_us(gpu)?;
        let (dev, batch, bytes) = (pass.dev, pass.job.step.batch, pass.bytes);
        pass.finished(host.start, end, || {
            tail_attrs(m, dev, batch, bytes).device_us(device_us)
        });
        Ok(())
    }
}

/// The tail's span: the head (one device's whole matrix) or the last residual.
fn tail_attrs(m: &GpuModel, dev: u32, batch: usize, bytes: u64) -> SpanAttrs {
    let (config, dtype) = (m.config(), m.weight_dtype());
    let a = SpanAttrs::compute(
        if m.placement().head {
            "head"
        } else {
            "residual"
        },
        dev,
    )
    // The head is one device's whole matrix.
    .blocks_of(config.hidden, 1);
    if m.placement().head {
        let head = cost::head(config, batch, dtype);
        a.family(KernelFamily::Matmul)
            .flops(head.flops)
            .bytes(head.bytes)
            .kernels(head.kernels)
            .head_part(cost::head_work(config, batch, dtype))
    } else {
        a.family(KernelFamily::Elementwise)
            .flops(0)
            .bytes(bytes * 3)
            .kernels(1)
    }
}

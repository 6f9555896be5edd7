//! A rank's host hand-offs: the previous pipeline stage's hidden states uploaded into the
//! step's input, and rank 0's output handed back (the head's picks, an encoder's pooled
//! embeddings, or hidden states for the next stage).

use std::time::Instant;

use super::collective::RankLink;
use super::compute::{picks, Compute};
use super::group::GroupOutput;
use super::pass::Pass;
use crate::device::Gpu;
use crate::error::{Result, WgparError};
use crate::model::Activations;
use crate::sim::Direction;

/// Uploads the previous stage's hidden states into the step's input (every rank needs them),
/// paced to the job's link.
pub(super) fn receive(
    link: &RankLink,
    gpu: &Gpu,
    act: &Activations,
    hidden: &[u8],
    pass: &mut Pass,
) -> Result<()> {
    let bytes = pass.bytes;
    if hidden.len() as u64 != bytes {
        return Err(WgparError::Shape {
            op: "hand-off".into(),
            detail: format!("received {} bytes, expected {bytes}", hidden.len()),
        });
    }
    let t0 = Instant::now();
    link.host().upload(gpu, act.x(), 0, hidden)?;
    if let Some(p) = &pass.job.pacer {
        p.pace(Direction::HostToDevice, bytes, t0);
    }
    pass.uploaded(t0, Instant::now());
    Ok(())
}

/// Rank 0's output of the step, read back (paced to the job's link) and recorded.
pub(super) fn hand_back(link: &RankLink, c: &Compute, pass: &mut Pass) -> Result<GroupOutput> {
    let (m, gpu, act) = (c.model, c.gpu, c.act);
    let step = pass.job.step;
    let t0 = Instant::now();
    let (output, what, n) = match (m.placement().head, m.output(act)) {
        (true, _) if picks(m) => {
            // The picks (and logits when asked) were copied out with the step.
            let o = m.read_out(act)?;
            let n = (4 * (2 * o.tokens.len() + o.logits.as_ref().map_or(0, Vec::len))) as u64;
            (GroupOutput::Picked(o), "tokens", n)
        }
        (true, Some((result, width))) => {
            let mut data = gpu.read_f32(result)?;
            data.truncate(step.batch * width);
            let n = (data.len() * 4) as u64;
            (GroupOutput::Pooled(data), "pooled", n)
        }
        _ => {
            let len = step.tokens() * m.config().hidden;
            let download = link.host().begin_download_range(gpu, act.x(), 0..len)?;
            (
                GroupOutput::Hidden(download.finish()?),
                "activations",
                pass.bytes,
            )
        }
    };
    if let Some(p) = &pass.job.pacer {
        p.pace(Direction::DeviceToHost, n, t0);
    }
    pass.downloaded(t0, Instant::now(), what, n);
    Ok(output)
}

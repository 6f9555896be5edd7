//! Hybrid TP x PP: a stage whose pass runs on a tensor-parallel group. Rank 0 returns the
//! hidden states (or the result) to hand on; there is no hand-off thread, as the group's
//! ranks synchronise through their all-reduces anyway.

use std::sync::Arc;
use std::time::Instant;

use super::handoff::{Payload, StageOut, Work};
use super::stage::Place;
use crate::error::{Result, WgparError};
use crate::parallel::tp::{GroupInput, GroupJob, GroupOutput, TpGroup};
use crate::trace::SpanId;

/// One pass of `work` on `group`: the job every rank runs, rank 0's output as the stage's,
/// accounted. Returns the work to hand on, its output and the span that delivered it.
pub(super) fn group_pass(
    group: &TpGroup,
    place: &Place,
    mut work: Work,
) -> Result<(Work, StageOut, SpanId)> {
    let begun = Instant::now();
    let job = group_job(place, &mut work);
    // A group has at least one rank, and rank 0 answers every job.
    let rank0 = group
        .run(job)?
        .into_iter()
        .next()
        .ok_or_else(|| WgparError::Internal("empty tensor-parallel group".into()))?;
    let (bytes, out) = stage_out(rank0.output)?;
    place.account(|s| {
        s.busy_s += rank0.compute_s;
        s.upload_s += rank0.upload_s;
        s.download_s += rank0.download_s;
        s.collective_s += rank0.comm_s - rank0.wait_s;
        s.occupied_s += begun.elapsed().as_secs_f64();
        s.bytes_in += rank0.upload_bytes;
        s.bytes_out += bytes as u64;
        s.collective_bytes += rank0.bytes;
        s.transfers += rank0.transfers;
        s.collectives += rank0.collectives;
        s.microbatches += 1;
    });
    Ok((work, out, rank0.last_span))
}

/// The group's job for `work` (its hidden states move into the job).
fn group_job(place: &Place, work: &mut Work) -> GroupJob {
    let input = if place.embeds {
        GroupInput::Ids(work.ids.clone())
    } else {
        GroupInput::Hidden(Arc::new(std::mem::take(&mut work.hidden)))
    };
    GroupJob {
        group: work.cache,
        input,
        step: work.step,
        new_cache: work.new_cache,
        release: work.release,
        recorder: work.recorder.clone(),
        microbatch: Some(work.group as u32),
        deps: work.deps.clone(),
        release_us: if place.embeds { work.release_us } else { None },
        rows: work.rows.clone(),
        slots: work.slots,
        encoder: work.encoder.clone(),
        pacer: work.pacer.clone(),
        readout: work.readout.clone(),
        kv_edits: work.kv_edits.clone(),
    }
}

/// Rank 0's output as the stage's, with its size in bytes.
fn stage_out(output: Option<GroupOutput>) -> Result<(usize, StageOut)> {
    Ok(match output {
        Some(GroupOutput::Hidden(h)) => (h.len(), StageOut::Hidden(h)),
        Some(GroupOutput::Picked(p)) => {
            let words = 2 * p.tokens.len() + p.logits.as_ref().map_or(0, Vec::len);
            (4 * words, StageOut::Final(Payload::Picked(p)))
        }
        Some(GroupOutput::Pooled(p)) => (4 * p.len(), StageOut::Final(Payload::Pooled(p))),
        // Rank 0 of a stage's group returns its stage's output on every job.
        None => return Err(WgparError::Internal("rank 0 returned nothing".into())),
    })
}

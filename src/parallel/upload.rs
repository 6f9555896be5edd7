//! Uploading an engine's parts of a model to its devices at once: each device copies its own
//! weights, in its own thread.

use std::sync::Arc;

use crate::device::{DType, Gpu};
use crate::error::{Result, WgparError};
use crate::model::{GpuModel, ModelWeights, Placement};

/// `weights` placed on each of `gpus` as `placements` say, stored as `dtype`; one result per
/// device, in order. `part` names what one device holds, for a panicking upload's error.
pub(crate) fn upload_parts(
    gpus: &[Arc<Gpu>],
    weights: &ModelWeights,
    dtype: DType,
    placements: Vec<Placement>,
    part: &str,
) -> Vec<Result<GpuModel>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = gpus
            .iter()
            .zip(placements)
            .map(|(gpu, placement)| {
                s.spawn(move || GpuModel::upload(gpu.clone(), weights, placement, dtype))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(WgparError::WorkerPanicked {
                        worker: "weight upload thread".into(),
                        message: format!("while uploading {part}"),
                    })
                })
            })
            .collect()
    })
}

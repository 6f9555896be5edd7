//! A worker's activations and KV caches (a pipeline stage's or a tensor-parallel rank's),
//! made on first use and kept between steps so the token loop allocates nothing.

use std::collections::HashMap;

use crate::error::Result;
use crate::model::{Activations, GpuModel, KvCache, Step};

/// Activations per step shape and KV caches per sequence group.
#[derive(Default)]
pub(crate) struct StepBuffers {
    /// Activations per (tokens, batch): hand-offs and all-reduces are exactly the step's size.
    acts: HashMap<(usize, usize), Activations>,
    /// KV caches per sequence group: a micro-batch, the serving cache, or 0 for plain tensor
    /// parallelism.
    caches: HashMap<usize, KvCache>,
}

impl StepBuffers {
    /// Makes `group`'s KV cache of `slots`. A cache of the same size is kept (with its bound
    /// ops): every row of the step's table starts where the table says.
    pub(crate) fn new_cache(&mut self, model: &GpuModel, group: usize, slots: usize) -> Result<()> {
        if self.caches.get(&group).map(KvCache::slots) != Some(slots) {
            let cache = model.kv_cache(slots)?;
            self.caches.insert(group, cache);
        }
        Ok(())
    }

    /// Makes the activations of `step`'s shape if there are none yet; says whether it did.
    pub(crate) fn make_acts(&mut self, model: &GpuModel, step: &Step) -> Result<bool> {
        let key = (step.tokens(), step.batch);
        if self.acts.contains_key(&key) {
            return Ok(false);
        }
        let act = model.activations(step.tokens(), step.batch)?;
        self.acts.insert(key, act);
        Ok(true)
    }

    /// The activations of `step`'s shape and `group`'s KV cache; `None` when either is
    /// missing (a group decoded before its prefill).
    pub(crate) fn get(
        &mut self,
        step: &Step,
        group: usize,
    ) -> Option<(&mut Activations, &mut KvCache)> {
        let act = self.acts.get_mut(&(step.tokens(), step.batch))?;
        Some((act, self.caches.get_mut(&group)?))
    }

    /// Drops `group`'s KV cache.
    pub(crate) fn release(&mut self, group: usize) {
        self.caches.remove(&group);
    }
}

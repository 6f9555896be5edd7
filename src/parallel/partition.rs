//! Splitting the layers into pipeline stages: even, explicit, or balanced by measured per-layer
//! time (and an optional memory budget) for unequal devices. The embedding sits on the first
//! stage and the LM head on the last; the balancer charges them to those stages.

use std::ops::Range;

use crate::error::{Result, WgparError};

/// How to split the layers.
#[derive(Debug, Clone, PartialEq)]
pub enum Partition {
    /// As equal as possible; leftover layers go to the middle stages, which carry neither the
    /// embedding nor the head.
    Even,
    /// Layer counts per stage (`--layers 5,7`).
    Explicit(Vec<usize>),
    /// Minimise the slowest stage's time given per-stage costs.
    Balanced(Vec<StageCost>),
}

/// Measured (or estimated) costs of one stage's device.
#[derive(Debug, Clone, PartialEq)]
pub struct StageCost {
    /// Seconds per decoder layer on this device.
    pub layer_s: f64,
    /// Seconds of the embedding lookup on this device (charged if it is the first stage).
    pub embed_s: f64,
    /// Seconds of the final norm + LM head (charged if it is the last stage).
    pub head_s: f64,
    /// Bytes per layer, and the device's budget for layers (None: no limit known; wgpu does
    /// not report device memory).
    pub memory: Option<(u64, u64)>,
}

/// Layer ranges for `stages` stages over `layers` layers.
pub fn partition(layers: usize, stages: usize, how: &Partition) -> Result<Vec<Range<usize>>> {
    if stages == 0 {
        return Err(WgparError::option(
            "--stages",
            "a pipeline needs at least one stage".into(),
        ));
    }
    if stages > layers {
        return Err(WgparError::unsupported(format!(
            "{stages} pipeline stages for {layers} layers: each stage needs at least one layer"
        )));
    }
    let counts = match how {
        Partition::Even => {
            let base = layers / stages;
            let extra = layers % stages;
            // Middle stages first: the ends also carry the embedding and head.
            let mut order: Vec<usize> = (1..stages.saturating_sub(1)).collect();
            order.extend([0, stages - 1]);
            let mut counts = vec![base; stages];
            for &s in order.iter().cycle().take(extra) {
                counts[s] += 1;
            }
            counts
        }
        Partition::Explicit(counts) => {
            if counts.len() != stages
                || counts.iter().sum::<usize>() != layers
                || counts.contains(&0)
            {
                return Err(WgparError::option(
                    "--layers",
                    format!(
                        "--layers {counts:?}: needs {stages} positive counts summing to {layers}"
                    ),
                ));
            }
            counts.clone()
        }
        Partition::Balanced(costs) => balanced(layers, costs)?,
    };
    let mut start = 0;
    Ok(counts
        .into_iter()
        .map(|c| {
            let r = start..start + c;
            start += c;
            r
        })
        .collect())
}

/// Time of stage `s` of `p` holding `n` layers.
pub(super) fn stage_time(s: usize, p: usize, n: usize, c: &StageCost) -> f64 {
    let mut t = n as f64 * c.layer_s;
    if s == 0 {
        t += c.embed_s;
    }
    if s + 1 == p {
        t += c.head_s;
    }
    t
}

fn fits(n: usize, c: &StageCost) -> bool {
    c.memory
        .is_none_or(|(per_layer, budget)| n as u64 * per_layer <= budget)
}

/// Dynamic programme over contiguous splits: minimise the slowest stage.
fn balanced(layers: usize, costs: &[StageCost]) -> Result<Vec<usize>> {
    let p = costs.len();
    for (stage, c) in costs.iter().enumerate() {
        let bad = [
            ("layer", c.layer_s, c.layer_s.is_nan() || c.layer_s <= 0.0),
            ("embedding", c.embed_s, c.embed_s < 0.0),
            ("head", c.head_s, c.head_s < 0.0),
        ];
        if let Some((what, seconds, _)) = bad.into_iter().find(|b| b.2) {
            return Err(WgparError::StageCost {
                stage,
                what: what.into(),
                seconds,
            });
        }
    }
    // best[s][l] = (slowest stage time, layers of stage s-1) for the first s stages holding l.
    let mut best = vec![vec![(f64::INFINITY, 0usize); layers + 1]; p + 1];
    best[0][0] = (0.0, 0);
    for s in 1..=p {
        for l in s..=layers {
            for n in 1..=l - (s - 1) {
                let prev = best[s - 1][l - n].0;
                if !prev.is_finite() || !fits(n, &costs[s - 1]) {
                    continue;
                }
                let t = prev.max(stage_time(s - 1, p, n, &costs[s - 1]));
                if t < best[s][l].0 {
                    best[s][l] = (t, n);
                }
            }
        }
    }
    if !best[p][layers].0.is_finite() {
        return Err(WgparError::unsupported(format!(
            "no split of {layers} layers over {p} stages fits the devices' memory budgets"
        )));
    }
    let mut counts = vec![0; p];
    let mut l = layers;
    for s in (1..=p).rev() {
        let n = best[s][l].1;
        counts[s - 1] = n;
        l -= n;
    }
    Ok(counts)
}

/// How close to the best predicted layer time an even head split may be and still be chosen:
/// equal devices measure a few percent apart, and an even split replicates no KV head.
pub const EVEN_SPLIT_SLACK: f64 = 0.05;

/// Query heads per device for tensor parallelism by measured speed: `layer_s[i]` is device
/// `i`'s time for a whole layer, so `h` heads take about `h / heads` of it, and the split
/// minimises the slowest device's share (each device holds one head first, then each further
/// head goes where it finishes soonest), device `i` holding at most `most[i]` heads. The even
/// split is kept when it is within [`EVEN_SPLIT_SLACK`] of that. `None` when the bounds leave
/// some head without a device, or a device without a head.
pub fn heads_by_speed(heads: usize, layer_s: &[f64], most: &[usize]) -> Option<Vec<usize>> {
    let n = layer_s.len();
    if n == 0 || n > heads || most.len() != n || most.contains(&0) {
        return None;
    }
    let mut split = vec![1; n];
    for _ in n..heads {
        let next = (0..n).filter(|&i| split[i] < most[i]).min_by(|&a, &b| {
            let t = |i: usize| (split[i] + 1) as f64 * layer_s[i];
            t(a).total_cmp(&t(b))
        })?;
        split[next] += 1;
    }
    let slowest =
        |s: &[usize]| (s.iter().zip(layer_s)).fold(0.0, |m, (&h, &t)| f64::max(m, h as f64 * t));
    let even = heads / n;
    if heads.is_multiple_of(n) && most.iter().all(|&m| m >= even) {
        let evenly = vec![even; n];
        if slowest(&evenly) <= slowest(&split) * (1.0 + EVEN_SPLIT_SLACK) {
            return Some(evenly);
        }
    }
    Some(split)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(layer_s: f64) -> StageCost {
        StageCost {
            layer_s,
            embed_s: 0.0,
            head_s: 0.0,
            memory: None,
        }
    }

    #[test]
    fn even_gives_leftovers_to_middle_stages() {
        assert_eq!(
            partition(10, 4, &Partition::Even).unwrap(),
            vec![0..2, 2..5, 5..8, 8..10]
        );
        assert_eq!(partition(6, 2, &Partition::Even).unwrap(), vec![0..3, 3..6]);
        assert_eq!(partition(7, 2, &Partition::Even).unwrap(), vec![0..4, 4..7]);
    }

    #[test]
    fn explicit_is_checked() {
        assert_eq!(
            partition(12, 2, &Partition::Explicit(vec![5, 7])).unwrap(),
            vec![0..5, 5..12]
        );
        let e = partition(12, 2, &Partition::Explicit(vec![5, 6]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("summing to 12"), "{e}");
        assert!(partition(2, 3, &Partition::Even).is_err());
    }

    #[test]
    fn balanced_gives_the_fast_device_more_layers() {
        // Device 0 three times faster: 12 layers split 9/3.
        let split = partition(12, 2, &Partition::Balanced(vec![cost(1.0), cost(3.0)])).unwrap();
        assert_eq!(split, vec![0..9, 9..12]);
    }

    #[test]
    fn balanced_charges_the_head_to_the_last_stage() {
        let mut last = cost(1.0);
        last.head_s = 4.0;
        let split = partition(12, 2, &Partition::Balanced(vec![cost(1.0), last])).unwrap();
        assert_eq!(split, vec![0..8, 8..12]);
    }

    #[test]
    fn balanced_respects_memory() {
        let mut small = cost(0.1);
        small.memory = Some((100, 250)); // at most 2 layers
        let split = partition(6, 2, &Partition::Balanced(vec![small, cost(1.0)])).unwrap();
        assert_eq!(split, vec![0..2, 2..6]);
    }

    #[test]
    fn heads_follow_measured_speed_within_bounds() {
        // A device three times faster takes three quarters of the heads.
        assert_eq!(heads_by_speed(8, &[1.0, 3.0], &[8, 8]), Some(vec![6, 2]));
        // Equal devices, and devices within the slack, split evenly; beyond it, not.
        assert_eq!(heads_by_speed(8, &[1.0, 1.0], &[8, 8]), Some(vec![4, 4]));
        assert_eq!(heads_by_speed(8, &[1.0, 1.04], &[8, 8]), Some(vec![4, 4]));
        assert_eq!(
            heads_by_speed(12, &[1.0, 1.5, 1.0], &[12; 3]),
            Some(vec![5, 3, 4])
        );
        // Bounds bind: the fast device may hold 5 heads only.
        assert_eq!(heads_by_speed(8, &[1.0, 3.0], &[5, 8]), Some(vec![5, 3]));
        // Seven heads over two equal devices: one more on the first.
        assert_eq!(heads_by_speed(7, &[1.0, 1.0], &[7, 7]), Some(vec![4, 3]));
        // No room for every head, a device without heads, more devices than heads.
        assert_eq!(heads_by_speed(8, &[1.0, 1.0], &[3, 3]), None);
        assert_eq!(heads_by_speed(8, &[1.0, 1.0], &[8, 0]), None);
        assert_eq!(heads_by_speed(2, &[1.0; 3], &[2; 3]), None);
    }
}

//! Which part of each layer a device holds: the Megatron pairing (attention Q/K/V and MLP
//! up/gate split by output rows, attention output and MLP down split by input columns).

use std::ops::Range;

use super::config::ModelConfig;
use crate::error::{Result, WgparError};

/// One device's share of every layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSpec {
    /// This device's rank in its tensor-parallel group.
    pub rank: usize,
    /// Group size.
    pub world: usize,
    /// Query heads held (global indices).
    pub q_heads: Range<usize>,
    /// Key/value heads held (global indices). With fewer KV heads than devices, or a split that
    /// cuts through a query group, a KV head is replicated on every device that needs it.
    pub kv_heads: Range<usize>,
    /// MLP inner columns held.
    pub ffn: Range<usize>,
}

/// Tensor-parallel degrees that split `config` evenly (heads divide, and KV heads either divide
/// or are replicated whole).
pub fn valid_tp_degrees(config: &ModelConfig) -> Vec<usize> {
    (1..=config.heads)
        .filter(|&d| {
            config.heads.is_multiple_of(d)
                && (config.kv_heads.is_multiple_of(d) || d.is_multiple_of(config.kv_heads))
        })
        .collect()
}

/// Splits `total` units into shares proportional to `weights` (largest remainder), each >= 1.
fn proportional(total: usize, weights: &[usize]) -> Option<Vec<usize>> {
    let sum: usize = weights.iter().sum();
    if sum == 0 || weights.contains(&0) || weights.len() > total {
        return None;
    }
    let mut shares: Vec<usize> = weights.iter().map(|w| total * w / sum).collect();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse((total * weights[i]) % sum));
    let mut left = total - shares.iter().sum::<usize>();
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        shares[i] += 1;
        left -= 1;
    }
    // Every device needs at least one unit: take from the largest shares.
    for i in 0..shares.len() {
        while shares[i] == 0 {
            let donor = (0..shares.len()).max_by_key(|&j| shares[j])?;
            if shares[donor] <= 1 {
                return None;
            }
            shares[donor] -= 1;
            shares[i] += 1;
        }
    }
    Some(shares)
}

fn ranges(shares: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    shares
        .iter()
        .map(|&s| {
            let r = start..start + s;
            start += s;
            r
        })
        .collect()
}

impl ShardSpec {
    /// The whole layer on one device.
    pub fn full(config: &ModelConfig) -> Self {
        Self {
            rank: 0,
            world: 1,
            q_heads: 0..config.heads,
            kv_heads: 0..config.kv_heads,
            ffn: 0..config.ffn,
        }
    }

    /// Shards for a tensor-parallel group with relative shares `split` (e.g. `[1, 1]` even,
    /// `[3, 1]` for a device three times faster). An even split must be a valid degree; an
    /// uneven one needs at least one query head per device.
    pub fn tensor_parallel(config: &ModelConfig, split: &[usize]) -> Result<Vec<Self>> {
        let world = split.len();
        let even = split.windows(2).all(|w| w[0] == w[1]);
        let valid = valid_tp_degrees(config);
        if world == 0 || (even && !valid.contains(&world)) || world > config.heads {
            return Err(WgparError::unsupported(format!(
                "tensor-parallel degree {world} does not split {} query / {} KV heads of model \
                 '{}'; valid degrees: {:?}",
                config.heads, config.kv_heads, config.name, valid
            )));
        }
        let heads = proportional(config.heads, split).ok_or_else(|| {
            WgparError::option(
                "--split",
                format!(
                    "split {split:?} leaves a device without query heads ({} heads)",
                    config.heads
                ),
            )
        })?;
        let ffn = proportional(config.ffn, split).ok_or_else(|| {
            WgparError::option(
                "--split",
                format!("split {split:?} cannot divide ffn {}", config.ffn),
            )
        })?;
        let group = config.heads / config.kv_heads;
        Ok(ranges(&heads)
            .into_iter()
            .zip(ranges(&ffn))
            .enumerate()
            .map(|(rank, (q, f))| Self {
                rank,
                world,
                kv_heads: q.start / group..q.end.div_ceil(group),
                q_heads: q,
                ffn: f,
            })
            .collect())
    }

    /// Query heads held.
    pub fn local_heads(&self) -> usize {
        self.q_heads.len()
    }

    /// KV heads held.
    pub fn local_kv_heads(&self) -> usize {
        self.kv_heads.len()
    }

    /// MLP columns held.
    pub fn local_ffn(&self) -> usize {
        self.ffn.len()
    }
}

/// Rows `range` (each `cols` wide) of a row-major matrix.
pub fn slice_rows(m: &[f32], cols: usize, range: Range<usize>) -> Vec<f32> {
    m[range.start * cols..range.end * cols].to_vec()
}

/// Columns `range` of a row-major `rows x cols` matrix.
pub fn slice_cols(m: &[f32], cols: usize, range: Range<usize>) -> Vec<f32> {
    m.chunks_exact(cols)
        .flat_map(|row| row[range.clone()].iter().copied())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(heads: usize, kv: usize) -> ModelConfig {
        ModelConfig {
            heads,
            kv_heads: kv,
            ..ModelConfig::preset("tiny-llama").unwrap()
        }
    }

    #[test]
    fn even_split_divides_heads_and_ffn() {
        let shards = ShardSpec::tensor_parallel(&cfg(6, 2), &[1, 1]).unwrap();
        assert_eq!(shards[0].q_heads, 0..3);
        assert_eq!(shards[1].q_heads, 3..6);
        assert_eq!(shards[0].kv_heads, 0..1);
        assert_eq!(shards[1].kv_heads, 1..2);
        assert_eq!(shards[0].ffn.len() + shards[1].ffn.len(), 172);
    }

    #[test]
    fn fewer_kv_heads_than_devices_replicates_them() {
        let shards = ShardSpec::tensor_parallel(&cfg(8, 2), &[1, 1, 1, 1]).unwrap();
        let kv: Vec<_> = shards.iter().map(|s| s.kv_heads.clone()).collect();
        assert_eq!(kv, vec![0..1, 0..1, 1..2, 1..2]);
    }

    #[test]
    fn invalid_degree_lists_valid_ones() {
        let e = ShardSpec::tensor_parallel(&cfg(6, 2), &[1, 1, 1, 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("valid degrees: [1, 2, 6]"), "{e}");
    }

    #[test]
    fn uneven_split_follows_weights() {
        let shards = ShardSpec::tensor_parallel(&cfg(12, 4), &[3, 1]).unwrap();
        assert_eq!(shards[0].q_heads, 0..9);
        assert_eq!(shards[1].q_heads, 9..12);
        assert_eq!(shards[1].kv_heads, 3..4);
    }

    #[test]
    fn slicing_rows_and_columns() {
        let m: Vec<f32> = (0..12).map(|x| x as f32).collect(); // 3 x 4
        assert_eq!(slice_rows(&m, 4, 1..2), vec![4.0, 5.0, 6.0, 7.0]);
        assert_eq!(slice_cols(&m, 4, 1..3), vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]);
    }
}

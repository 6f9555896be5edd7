//! Small statistics over measured samples.

/// The middle value of `values` (the upper of the two middle ones for an even count, so the
/// result is always a value that was measured); `None` when there are none. NaNs sort last.
pub fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied()
}

/// The `q`-th percentile (0..=100) of `values`, interpolating linearly between the two
/// nearest ranks (as numpy's default and vLLM's serving benchmark do); `None` when there are
/// none. NaNs sort last.
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let last = v.len().checked_sub(1)?;
    let pos = (q.clamp(0.0, 100.0) / 100.0) * last as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    Some(v[lo] + (v[hi] - v[lo]) * (pos - lo as f64))
}

/// The `q` quantile (0..=1) by nearest rank: the smallest value with at least a share `q` of
/// the values at or below it, always a value that was measured (the collective benchmarks'
/// p50/p99, as nccl-tests and OSU report them); `None` when there are none. NaNs sort last.
pub fn nearest_rank(values: &[f64], q: f64) -> Option<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let rank = ((n as f64 * q.clamp(0.0, 1.0)).ceil() as usize).clamp(1, n.max(1));
    v.get(rank - 1).copied()
}

#[cfg(test)]
mod tests {
    use super::{median, nearest_rank, percentile};

    #[test]
    fn nearest_ranks_are_measured_values() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(nearest_rank(&v, 0.5), Some(50.0));
        assert_eq!(nearest_rank(&v, 0.99), Some(99.0));
        assert_eq!(nearest_rank(&v, 0.0), Some(1.0));
        assert_eq!(nearest_rank(&[], 0.5), None);
    }

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v = [4.0, 1.0, 3.0, 2.0, 5.0];
        assert_eq!(percentile(&v, 50.0), Some(3.0));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(5.0));
        assert!((percentile(&v, 90.0).unwrap() - 4.6).abs() < 1e-12);
        assert!((percentile(&[1.0, 2.0], 99.0).unwrap() - 1.99).abs() < 1e-12);
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn middle_value_upper_for_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), Some(3.0));
        assert_eq!(median(vec![5.0]), Some(5.0));
        assert_eq!(median(Vec::new()), None);
    }
}

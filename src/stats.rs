//! Small statistics over measured samples.

/// The middle value of `values` (the upper of the two middle ones for an even count, so the
/// result is always a value that was measured); `None` when there are none. NaNs sort last.
pub fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied()
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn middle_value_upper_for_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), Some(3.0));
        assert_eq!(median(vec![5.0]), Some(5.0));
        assert_eq!(median(Vec::new()), None);
    }
}

//! Fitting the alpha-beta link model `t = alpha + bytes / beta` to a size sweep.

use super::profile::LinkSpec;

/// Result of [`fit_alpha_beta`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AlphaBetaFit {
    /// Latency, microseconds (can come out slightly negative on noisy data; see
    /// [`AlphaBetaFit::link`]).
    pub alpha_us: f64,
    /// Bandwidth, GB/s (GB = 1e9 bytes).
    pub beta_gbps: f64,
    /// Coefficient of determination of the fitted line over the raw times (1 = perfect).
    pub r_squared: f64,
    /// Root mean square of the relative residuals `(t - fit) / t`.
    pub rms_relative_residual: f64,
    /// Number of points fitted.
    pub points: usize,
}

impl AlphaBetaFit {
    /// The fit as a profile link; a negative alpha is clamped to zero.
    pub fn link(&self) -> LinkSpec {
        LinkSpec {
            alpha_us: self.alpha_us.max(0.0),
            beta_gbps: self.beta_gbps,
        }
    }
}

/// Why a sweep cannot be fitted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FitError {
    /// Fewer than two points: a line needs two.
    #[error("alpha-beta fit needs at least 2 points, got {found}")]
    TooFewPoints {
        /// Points given.
        found: usize,
    },
    /// Every point has the same size, so latency and bandwidth cannot be told apart.
    #[error("alpha-beta fit needs at least 2 distinct sizes; every point has {bytes} bytes")]
    SingleSize {
        /// The one size.
        bytes: u64,
    },
    /// A time that is zero, negative, infinite or NaN.
    #[error("point {index} ({bytes} bytes) has time {seconds} s; times must be finite and > 0")]
    BadTime {
        /// Index of the point.
        index: usize,
        /// Its size.
        bytes: u64,
        /// Its time.
        seconds: f64,
    },
    /// Time does not grow with size, so there is no finite bandwidth.
    #[error("fitted time per byte is {us_per_mb} us/MB; times must grow with size")]
    NoBandwidth {
        /// Fitted slope, microseconds per megabyte.
        us_per_mb: f64,
    },
}

/// Least-squares fit of `t = alpha + bytes / beta` over `(bytes, seconds)` points.
///
/// Residuals are weighted by `1 / t^2`, i.e. the fit minimises *relative* error. A sweep spans
/// several orders of magnitude (8 B to 256 MB); with plain least squares the largest sizes
/// would own the fit and alpha, which only the small sizes reveal, would be noise.
pub fn fit_alpha_beta(points: &[(u64, f64)]) -> Result<AlphaBetaFit, FitError> {
    if points.len() < 2 {
        return Err(FitError::TooFewPoints {
            found: points.len(),
        });
    }
    for (index, &(bytes, seconds)) in points.iter().enumerate() {
        if !(seconds.is_finite() && seconds > 0.0) {
            return Err(FitError::BadTime {
                index,
                bytes,
                seconds,
            });
        }
    }
    let first = points[0].0;
    if points.iter().all(|p| p.0 == first) {
        return Err(FitError::SingleSize { bytes: first });
    }

    // Work in microseconds and bytes: alpha comes out in us, the slope in us per byte.
    let xs: Vec<f64> = points.iter().map(|p| p.0 as f64).collect();
    let ys: Vec<f64> = points.iter().map(|p| p.1 * 1e6).collect();
    let ws: Vec<f64> = ys.iter().map(|y| 1.0 / (y * y)).collect();
    let sw: f64 = ws.iter().sum();
    let mean = |v: &[f64]| v.iter().zip(&ws).map(|(x, w)| x * w).sum::<f64>() / sw;
    let (mx, my) = (mean(&xs), mean(&ys));
    // Centred sums keep the normal equations well conditioned for sizes up to 1e9.
    let sxx: f64 = xs
        .iter()
        .zip(&ws)
        .map(|(x, w)| w * (x - mx) * (x - mx))
        .sum();
    let sxy: f64 = xs
        .iter()
        .zip(&ys)
        .zip(&ws)
        .map(|((x, y), w)| w * (x - mx) * (y - my))
        .sum();
    let slope = sxy / sxx;
    if !(slope.is_finite() && slope > 0.0) {
        return Err(FitError::NoBandwidth {
            us_per_mb: slope * 1e6,
        });
    }
    let alpha_us = my - slope * mx;

    let fitted = |x: f64| alpha_us + slope * x;
    let plain_mean = ys.iter().sum::<f64>() / ys.len() as f64;
    let ss_tot: f64 = ys.iter().map(|y| (y - plain_mean).powi(2)).sum();
    let ss_res: f64 = xs
        .iter()
        .zip(&ys)
        .map(|(x, y)| (y - fitted(*x)).powi(2))
        .sum();
    let rel: f64 = xs
        .iter()
        .zip(&ys)
        .map(|(x, y)| ((y - fitted(*x)) / y).powi(2))
        .sum::<f64>()
        / ys.len() as f64;
    Ok(AlphaBetaFit {
        alpha_us,
        // slope is us per byte; bytes per us = 1 / slope; GB/s = bytes per us / 1e3.
        beta_gbps: 1.0 / (slope * 1e3),
        r_squared: if ss_tot > 0.0 {
            1.0 - ss_res / ss_tot
        } else {
            1.0
        },
        rms_relative_residual: rel.sqrt(),
        points: points.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sweep(alpha_us: f64, beta_gbps: f64) -> Vec<(u64, f64)> {
        (3..=28)
            .map(|k| {
                let bytes = 1u64 << k;
                (bytes, (alpha_us + bytes as f64 / (beta_gbps * 1e3)) * 1e-6)
            })
            .collect()
    }

    #[test]
    fn exact_data_gives_exact_parameters() {
        let fit = fit_alpha_beta(&sweep(10.0, 25.0)).unwrap();
        assert!((fit.alpha_us - 10.0).abs() < 1e-9, "{fit:?}");
        assert!((fit.beta_gbps - 25.0).abs() < 1e-9, "{fit:?}");
        assert!((fit.r_squared - 1.0).abs() < 1e-12);
        assert!(fit.rms_relative_residual < 1e-12);
        assert_eq!(fit.points, 26);
    }

    #[test]
    fn noisy_sweep_recovers_parameters() {
        use rand::{Rng, SeedableRng};
        // PCIe 4.0-like link, each size timed 5 times with +-3% uniform noise.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(42);
        let points: Vec<(u64, f64)> = sweep(10.0, 25.0)
            .into_iter()
            .flat_map(|p| std::iter::repeat_n(p, 5))
            .map(|(b, t)| (b, t * (1.0 + rng.random_range(-0.03..0.03))))
            .collect();
        let fit = fit_alpha_beta(&points).unwrap();
        assert!((fit.alpha_us - 10.0).abs() < 0.3, "{fit:?}");
        assert!((fit.beta_gbps - 25.0).abs() < 0.5, "{fit:?}");
        assert!(fit.r_squared > 0.99, "{fit:?}");
        // Uniform noise of +-3% has an RMS of 3% / sqrt(3) = 1.7%.
        assert!(
            (0.012..0.022).contains(&fit.rms_relative_residual),
            "{fit:?}"
        );
    }

    #[test]
    fn two_points_define_the_line() {
        // 1 MB in 50 us and 2 MB in 90 us: 40 us per MB = 25 GB/s, alpha 10 us.
        let fit = fit_alpha_beta(&[(1_000_000, 50e-6), (2_000_000, 90e-6)]).unwrap();
        assert!((fit.alpha_us - 10.0).abs() < 1e-9);
        assert!((fit.beta_gbps - 25.0).abs() < 1e-9);
    }

    #[test]
    fn degenerate_input_is_an_error() {
        assert_eq!(
            fit_alpha_beta(&[(8, 1e-5)]),
            Err(FitError::TooFewPoints { found: 1 })
        );
        assert_eq!(
            fit_alpha_beta(&[(8, 1e-5), (8, 2e-5)]),
            Err(FitError::SingleSize { bytes: 8 })
        );
        assert!(matches!(
            fit_alpha_beta(&[(8, 1e-5), (16, 0.0)]),
            Err(FitError::BadTime { index: 1, .. })
        ));
        assert!(matches!(
            fit_alpha_beta(&[(8, 2e-5), (16, 1e-5)]),
            Err(FitError::NoBandwidth { .. })
        ));
    }

    #[test]
    fn negative_alpha_is_clamped_in_the_link() {
        let fit = fit_alpha_beta(&[(1_000_000, 30e-6), (2_000_000, 70e-6)]).unwrap();
        assert!((fit.alpha_us + 10.0).abs() < 1e-9);
        assert_eq!(fit.link().alpha_us, 0.0);
    }
}

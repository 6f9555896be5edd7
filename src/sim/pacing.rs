//! Link pacing: slowing real transfers down to a modelled link, so that a run on one box (for
//! instance virtual devices on a CPU driver, whose "transfers" are memcpys) behaves like the
//! machine a profile describes, e.g. PCIe 3.0 x16 or a 1 Gb/s network.
//!
//! A pacer never speeds anything up: each call sleeps until the operation's modelled end
//! (`started + model time`) and returns at once when the real operation already took longer.
//!
//! ```
//! use std::time::Instant;
//! use wgpar::sim::{Direction, LinkPacer, LinkSpec};
//! // A 1 Gb/s network: 125 MB/s, 50 us per message.
//! let pacer = LinkPacer::from_link(LinkSpec { alpha_us: 50.0, beta_gbps: 0.125 });
//! let started = Instant::now();
//! /* ... the real copy of 125_000 bytes ... */
//! pacer.pace(Direction::DeviceToHost, 125_000, started); // returns >= 1.05 ms after `started`
//! assert!(started.elapsed().as_secs_f64() >= 1.05e-3);
//! ```

use std::time::{Duration, Instant};

use crate::trace::CollectiveOp;

use super::cost::{Algorithm, CostModel};
use super::profile::{DeviceSpec, HostLinkSpec, HostProfile, HostSpec, LinkSpec, Rates};
use super::project_error::ProjectError;

/// Which way a paced copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Device memory to host memory.
    DeviceToHost,
    /// Host memory to device memory.
    HostToDevice,
    /// Device to host, then host to another device (a pipeline hand-off paced as one call).
    DeviceToDevice,
}

/// Why a pacer cannot be built or cannot model a call.
#[derive(Debug, thiserror::Error)]
pub enum PacingError {
    /// The profile has no device with this index.
    #[error("profile `{profile}` has {available} devices; cannot pace device {device}")]
    NoDevice {
        /// Profile name.
        profile: String,
        /// Device asked for.
        device: usize,
        /// Devices in the profile.
        available: usize,
    },
    /// A link outside what a host profile may describe (latency 0 to 10 s, bandwidth 0.1 MB/s
    /// to 1 PB/s): beyond them a paced run would sleep for hours.
    #[error("link alpha {alpha_us} us, beta {beta_gbps} GB/s: {field} {reason}")]
    BadLink {
        /// Latency given.
        alpha_us: f64,
        /// Bandwidth given.
        beta_gbps: f64,
        /// The field out of range: `alpha_us` or `beta_gbps`.
        field: &'static str,
        /// The range it must be within.
        reason: &'static str,
    },
    /// A link given as `ALPHA_US:BETA_GBPS` with a part that is not a number.
    #[error(
        "'{text}': the {which} '{part}' is not a number; a link is ALPHA_US:BETA_GBPS, e.g. \
         50:0.125 for 50 us and 1 Gb/s (or give a host profile name or file)"
    )]
    NotANumber {
        /// The whole text.
        text: String,
        /// `latency (ALPHA_US)` or `bandwidth (BETA_GBPS)`.
        which: &'static str,
        /// The part that did not parse.
        part: String,
    },
    /// The cost model refused the collective (e.g. more participants than the profile has).
    #[error("cannot model the collective: {0}")]
    Model(#[from] ProjectError),
}

/// What a `--pace` argument names: one explicit link, or a host profile.
#[derive(Debug, Clone, PartialEq)]
pub enum PaceSpec {
    /// `ALPHA_US:BETA_GBPS`.
    Link {
        /// Latency, microseconds.
        alpha_us: f64,
        /// Bandwidth, GB/s.
        beta_gbps: f64,
    },
    /// A profile name or file.
    Profile(String),
}

impl PaceSpec {
    /// Reads `ALPHA_US:BETA_GBPS` (two numbers around one colon, e.g. `50:0.125`) as a link
    /// and anything else as a profile name or file. Text shaped like a link but with a part
    /// that is not a number (`5:abc`) is an error naming that part, not a profile lookup; an
    /// existing file wins over the link reading.
    pub fn parse(text: &str) -> Result<PaceSpec, PacingError> {
        if std::path::Path::new(text).exists() {
            return Ok(PaceSpec::Profile(text.to_owned()));
        }
        let Some((a, b)) = text.split_once(':') else {
            return Ok(PaceSpec::Profile(text.to_owned()));
        };
        if b.contains(':') || a.contains(['/', '\\']) || b.contains(['/', '\\']) {
            return Ok(PaceSpec::Profile(text.to_owned()));
        }
        let number = |part: &str, which| {
            part.trim()
                .parse::<f64>()
                .map_err(|_| PacingError::NotANumber {
                    text: text.to_owned(),
                    which,
                    part: part.to_owned(),
                })
        };
        let alpha_us = number(a, "latency (ALPHA_US)")?;
        let beta_gbps = number(b, "bandwidth (BETA_GBPS)")?;
        Ok(PaceSpec::Link {
            alpha_us,
            beta_gbps,
        })
    }
}

/// Sleeps transfers and collectives up to the time a profile's links would take.
///
/// Built for one device (its host link paces [`LinkPacer::pace`]); collectives are modelled
/// over devices `0..participants` of the profile, as the engines number their ranks.
#[derive(Debug, Clone)]
pub struct LinkPacer {
    profile: HostProfile,
    device: usize,
}

impl LinkPacer {
    /// Paces device `device`'s host link as profile `profile` describes it.
    pub fn from_profile(profile: &HostProfile, device: usize) -> Result<Self, PacingError> {
        if profile.device(device).is_none() {
            return Err(PacingError::NoDevice {
                profile: profile.name.clone(),
                device,
                available: profile.device_count(),
            });
        }
        Ok(Self {
            profile: profile.clone(),
            device,
        })
    }

    /// Paces both directions with one explicit link (e.g. alpha 50 us, beta 0.125 GB/s for a
    /// 1 Gb/s network). Collectives are then modelled on devices that each own such a link and
    /// a host whose reduction costs nothing, so only the link is paced.
    pub fn from_link(link: LinkSpec) -> Self {
        Self::from_links(link, link)
    }

    /// Like [`LinkPacer::from_link`] with a different link per direction.
    pub fn from_links(h2d: LinkSpec, d2h: LinkSpec) -> Self {
        Self {
            profile: link_only_profile(h2d, d2h),
            device: 0,
        }
    }

    /// [`LinkPacer::from_link`] after checking the numbers (alpha >= 0, beta > 0, finite).
    pub fn from_alpha_beta(alpha_us: f64, beta_gbps: f64) -> Result<Self, PacingError> {
        // The bounds a host profile's links must keep.
        let root = super::locate::FieldPath::root();
        let checks = [
            ("alpha_us", super::rules::latency_us(&root, alpha_us)),
            ("beta_gbps", super::rules::bandwidth_gbps(&root, beta_gbps)),
        ];
        if let Some((field, Err(v))) = checks.into_iter().find(|(_, c)| c.is_err()) {
            return Err(PacingError::BadLink {
                alpha_us,
                beta_gbps,
                field,
                reason: v.reason,
            });
        }
        Ok(Self::from_link(LinkSpec {
            alpha_us,
            beta_gbps,
        }))
    }

    /// The profile the pacer models (a synthetic one for explicit links).
    pub fn profile(&self) -> &HostProfile {
        &self.profile
    }

    /// Modelled time of a copy of `bytes` in `direction`, microseconds.
    pub fn model_us(&self, direction: Direction, bytes: u64) -> f64 {
        let link = &self.spec().host_link;
        let b = bytes as f64;
        match direction {
            Direction::DeviceToHost => link.d2h.time_us(b),
            Direction::HostToDevice => link.h2d.time_us(b),
            Direction::DeviceToDevice => link.d2h.time_us(b) + link.h2d.time_us(b),
        }
    }

    /// Sleeps until `started` + the modelled time of a copy of `bytes` in `direction`; returns
    /// how long it slept (zero when the real copy was already slower than the model).
    ///
    /// Call it right after the real copy completes, with `started` taken just before the copy
    /// was issued. The OS may oversleep by some tens of microseconds; it never undersleeps.
    pub fn pace(&self, direction: Direction, bytes: u64, started: Instant) -> Duration {
        sleep_until(started, self.model_us(direction, bytes))
    }

    /// Modelled time of collective `op` of size `bytes` (S, nccl-tests convention) over
    /// devices `0..participants`, with `algorithm`, microseconds.
    pub fn collective_us(
        &self,
        op: CollectiveOp,
        algorithm: Algorithm,
        bytes: u64,
        participants: usize,
    ) -> Result<f64, PacingError> {
        let devices: Vec<usize> = (0..participants).collect();
        Ok(CostModel::new(&self.profile).collective_us(op, algorithm, &devices, bytes, 1)?)
    }

    /// Sleeps until `started` + the modelled time of a collective (see
    /// [`LinkPacer::collective_us`]); returns how long it slept. Every participant calls it
    /// after its own part of the real collective, with the `started` of its own call.
    pub fn collective(
        &self,
        op: CollectiveOp,
        algorithm: Algorithm,
        bytes: u64,
        participants: usize,
        started: Instant,
    ) -> Result<Duration, PacingError> {
        let us = self.collective_us(op, algorithm, bytes, participants)?;
        Ok(sleep_until(started, us))
    }

    fn spec(&self) -> &DeviceSpec {
        // `from_profile` checked the index; the synthetic profile has device 0.
        match self.profile.device(self.device) {
            Some(d) => d,
            None => &self.profile.devices[0],
        }
    }
}

/// Sleeps until `started + us`; returns the time slept.
fn sleep_until(started: Instant, us: f64) -> Duration {
    let target = Duration::from_secs_f64(us.max(0.0) / 1e6);
    let elapsed = started.elapsed();
    match target.checked_sub(elapsed) {
        Some(left) if !left.is_zero() => {
            std::thread::sleep(left);
            left
        }
        _ => Duration::ZERO,
    }
}

/// A profile with many devices that each own the given link, and a host whose reduction is
/// free: what an explicit-link pacer models collectives on.
fn link_only_profile(h2d: LinkSpec, d2h: LinkSpec) -> HostProfile {
    HostProfile {
        name: "paced-link".into(),
        description: "an explicit link given to the pacer".into(),
        nodes: 1,
        host: HostSpec {
            name: "unmodelled host".into(),
            // Host work is not what is being paced: make the reduction cost nothing.
            memory_gbps: f64::MAX,
            collective_overhead_us: Vec::new(),
        },
        devices: vec![DeviceSpec {
            name: "paced device".into(),
            count: 1024,
            memory_bytes: u64::MAX,
            memory_gbps: f64::MAX,
            f32_tflops: f64::MAX,
            f16_tflops: f64::MAX,
            f16_tensor_tflops: None,
            launch_overhead_us: 0.0,
            submit_overhead_us: None,
            host_link: HostLinkSpec {
                name: "paced link".into(),
                shared_by: 1,
                p2p: false,
                h2d,
                d2h,
            },
            rates: Rates::default(),
            compute_sharing: None,
        }],
        device_link: None,
        network: None,
    }
}

/// The pacer `--pace` names: one link as `ALPHA_US:BETA_GBPS`, else a host profile (device 0's
/// host link, collectives by the profile's cost model). Also says what it paces to.
pub fn pacer_for(text: &str) -> crate::error::Result<(LinkPacer, String)> {
    let spec = PaceSpec::parse(text).map_err(|source| crate::error::WgparError::Pacing {
        target: format!("--pace {text}"),
        source,
    })?;
    let name = match spec {
        PaceSpec::Link {
            alpha_us,
            beta_gbps,
        } => {
            let pacer = LinkPacer::from_alpha_beta(alpha_us, beta_gbps).map_err(|source| {
                crate::error::WgparError::Pacing {
                    target: format!("--pace {text}"),
                    source,
                }
            })?;
            return Ok((
                pacer,
                format!("one link of {alpha_us} us + bytes / {beta_gbps} GB/s per message"),
            ));
        }
        PaceSpec::Profile(name) => name,
    };
    let profile = HostProfile::resolve(&name)?;
    let pacer = LinkPacer::from_profile(&profile, 0).map_err(|source| {
        crate::error::WgparError::Pacing {
            target: format!("profile {}", profile.name),
            source,
        }
    })?;
    Ok((pacer, format!("the links of {}", profile.name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(d: Duration) -> f64 {
        d.as_secs_f64()
    }

    #[test]
    fn pace_specs_are_links_or_profiles() {
        assert_eq!(
            PaceSpec::parse("50:0.125").unwrap(),
            PaceSpec::Link {
                alpha_us: 50.0,
                beta_gbps: 0.125
            }
        );
        assert_eq!(
            PaceSpec::parse("pcie3-2gpu").unwrap(),
            PaceSpec::Profile("pcie3-2gpu".into())
        );
        let e = PaceSpec::parse("5:abc").unwrap_err().to_string();
        assert!(e.contains("'abc'") && e.contains("BETA_GBPS"), "{e}");
        let e = PaceSpec::parse("x:1").unwrap_err().to_string();
        assert!(e.contains("'x'") && e.contains("ALPHA_US"), "{e}");
    }

    #[test]
    fn pace_sleeps_up_to_the_model_and_no_further() {
        // 2 ms latency, 1 GB/s: 1 MB takes 2 ms + 1 ms.
        let p = LinkPacer::from_alpha_beta(2000.0, 1.0).unwrap();
        assert_eq!(p.model_us(Direction::DeviceToHost, 1_000_000), 3000.0);
        assert_eq!(p.model_us(Direction::DeviceToDevice, 1_000_000), 6000.0);
        let started = Instant::now();
        let slept = p.pace(Direction::HostToDevice, 1_000_000, started);
        let elapsed = secs(started.elapsed());
        assert!(elapsed >= 3e-3, "elapsed {elapsed}");
        // Sleep overshoot is bounded loosely: a loaded CI box may be slow to wake us.
        assert!(elapsed < 3e-3 + 0.25, "elapsed {elapsed}");
        assert!(secs(slept) > 2e-3 && secs(slept) <= 3e-3, "slept {slept:?}");

        // A copy that already took longer than the model is not slowed further.
        let long_ago = Instant::now() - Duration::from_millis(50);
        assert_eq!(
            p.pace(Direction::DeviceToHost, 1_000_000, long_ago),
            Duration::ZERO
        );
    }

    #[test]
    fn profile_links_and_collectives_follow_the_cost_model() {
        let profile = HostProfile::shipped("pcie3-2gpu").unwrap();
        let p = LinkPacer::from_profile(&profile, 1).unwrap();
        let link = &profile.device(1).unwrap().host_link;
        assert_eq!(
            p.model_us(Direction::DeviceToHost, 4_000_000),
            link.d2h.time_us(4e6)
        );
        // 4 MB host-staged all-reduce over both devices: the cost model's number.
        let model = CostModel::new(&profile)
            .collective_us(
                CollectiveOp::AllReduce,
                Algorithm::HostStaged,
                &[0, 1],
                4_000_000,
                1,
            )
            .unwrap();
        let us = p
            .collective_us(CollectiveOp::AllReduce, Algorithm::HostStaged, 4_000_000, 2)
            .unwrap();
        assert_eq!(us, model);
        let started = Instant::now();
        p.collective(
            CollectiveOp::AllReduce,
            Algorithm::HostStaged,
            4_000_000,
            2,
            started,
        )
        .unwrap();
        assert!(secs(started.elapsed()) >= us / 1e6);

        assert!(matches!(
            LinkPacer::from_profile(&profile, 2),
            Err(PacingError::NoDevice { available: 2, .. })
        ));
        assert!(matches!(
            p.collective_us(CollectiveOp::AllReduce, Algorithm::HostStaged, 8, 3),
            Err(PacingError::Model(_))
        ));
    }

    #[test]
    fn explicit_link_collective_pays_the_link_only() {
        // alpha 10 us, 1 GB/s (1 kB per us): a host-staged all-reduce of 1 MB is one download
        // and one upload per device, overlapping across devices: 2 x (10 + 1000) us.
        let p = LinkPacer::from_alpha_beta(10.0, 1.0).unwrap();
        let us = p
            .collective_us(CollectiveOp::AllReduce, Algorithm::HostStaged, 1_000_000, 4)
            .unwrap();
        assert!((us - 2020.0).abs() < 1e-6, "{us}");
        assert!(LinkPacer::from_alpha_beta(-1.0, 1.0).is_err());
        assert!(LinkPacer::from_alpha_beta(1.0, 0.0).is_err());
        assert!(LinkPacer::from_alpha_beta(1.0, f64::NAN).is_err());
    }

    #[test]
    fn pace_takes_a_link_or_a_profile() {
        let (gbit, what) = pacer_for("50:0.125").unwrap();
        assert!(
            what.contains("50 us") && what.contains("0.125 GB/s"),
            "{what}"
        );
        // 1 MB over 1 Gb/s: 50 us + 8 ms.
        let t = gbit.model_us(Direction::DeviceToHost, 1_000_000);
        assert!((t - 8050.0).abs() < 1e-6, "{t}");
        let (_, what) = pacer_for("pcie3-2gpu").unwrap();
        assert!(what.contains("pcie3-2gpu"), "{what}");
        let e = pacer_for("50:-1").unwrap_err().to_string();
        assert!(e.contains("--pace 50:-1"), "{e}");
        // A link with a bad number names the number, not a missing profile.
        let e = pacer_for("5:abc").unwrap_err().to_string();
        assert!(
            e.contains("'abc'") && !e.contains("shipped profiles"),
            "{e}"
        );
        assert!(pacer_for("no-such-profile").is_err());
    }
}

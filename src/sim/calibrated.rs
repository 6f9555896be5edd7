//! Turning measurements of "this machine" into a host profile (`wgpar calibrate`).

use std::path::Path;

use super::fit::AlphaBetaFit;
use super::profile::{ComputeSharing, DeviceSpec, HostLinkSpec, HostProfile, HostSpec, Rates};
use super::profile_error::ProfileError;

/// What `wgpar calibrate` measured on one device (or on one of several identical devices).
#[derive(Debug, Clone, PartialEq)]
pub struct MeasuredDevice {
    /// Adapter name and backend, e.g. `NVIDIA GeForce RTX 4090 (Vulkan)`.
    pub name: String,
    /// How many identical devices this measurement stands for (virtual devices on one
    /// adapter are measured once).
    pub count: u32,
    /// Device memory, bytes (from the adapter's limits or the driver).
    pub memory_bytes: u64,
    /// Fit of the host-to-device sweep.
    pub h2d: AlphaBetaFit,
    /// Fit of the device-to-host sweep.
    pub d2h: AlphaBetaFit,
    /// Achieved f32 matmul rate, GFLOP/s.
    pub matmul_gflops: f64,
    /// Achieved f16 matmul rate, GFLOP/s, if measured.
    pub matmul_f16_gflops: Option<f64>,
    /// Achieved attention rate, GFLOP/s, if measured.
    pub attention_gflops: Option<f64>,
    /// Achieved bandwidth of a streaming element-wise kernel, GB/s (bytes read plus written).
    pub elementwise_gbps: f64,
    /// Cost of one more dispatch in a submission, microseconds.
    pub launch_overhead_us: f64,
    /// Fixed host cost of one submission and its wait, beyond its dispatches, microseconds.
    pub submit_overhead_us: f64,
    /// Matmul-family rate by arithmetic intensity, `[flops per byte, GFLOP/s]` (may be empty).
    pub matmul_curve: Vec<[f64; 2]>,
    /// Attention-family rate by arithmetic intensity (may be empty).
    pub attention_curve: Vec<[f64; 2]>,
    /// Matmul-family rate by intensity and block width, one curve per measured block width
    /// (`surface_widths`), points `[flops per byte, MFLOP per dispatch, GFLOP/s]` (may be
    /// empty).
    pub matmul_surface: Vec<Vec<[f64; 3]>>,
    /// Attention-family rate by intensity and block width (may be empty).
    pub attention_surface: Vec<Vec<[f64; 3]>>,
    /// The block width each curve of both surfaces was measured at, in their order (empty
    /// with empty surfaces).
    pub surface_widths: Vec<f64>,
    /// Final norm and LM head rate by arithmetic intensity (may be empty).
    pub head_curve: Vec<[f64; 2]>,
    /// Whether the `count` devices share one processor, and the measured slowdown.
    pub compute_sharing: Option<ComputeSharing>,
}

/// Everything measured on one machine.
#[derive(Debug, Clone, PartialEq)]
pub struct MachineMeasurement {
    /// Profile name, e.g. `this-machine`.
    pub name: String,
    /// One line about the machine (CPU, OS, driver).
    pub description: String,
    /// CPU description.
    pub host_name: String,
    /// Achieved host reduce rate, GB/s, counting bytes read plus written (the unit of a
    /// host-reduce span's `bytes`).
    pub host_reduce_gbps: f64,
    /// Fixed cost of a host-staged collective with 2, 3, ... participants, microseconds
    /// (empty when there was one device).
    pub collective_overhead_us: Vec<f64>,
    /// The devices, in wgpar's device order.
    pub devices: Vec<MeasuredDevice>,
}

/// A validated profile built from measurements; each measured device becomes its own group
/// (of `count` identical devices) so that its own rates are kept. Peaks are set to the
/// measured rates (a calibrated roofline).
///
/// Devices were measured one at a time, so each gets its own uplink (`shared_by = 1`); edit
/// the file if the devices sit behind one switch.
pub fn calibrated_profile(m: &MachineMeasurement) -> Result<HostProfile, ProfileError> {
    let devices = m
        .devices
        .iter()
        .map(|d| DeviceSpec {
            name: d.name.clone(),
            count: d.count,
            memory_bytes: d.memory_bytes,
            memory_gbps: d.elementwise_gbps,
            f32_tflops: d.matmul_gflops / 1e3,
            f16_tflops: d.matmul_f16_gflops.unwrap_or(d.matmul_gflops) / 1e3,
            f16_tensor_tflops: None,
            launch_overhead_us: d.launch_overhead_us,
            submit_overhead_us: Some(d.submit_overhead_us),
            host_link: HostLinkSpec {
                name: "measured host link".into(),
                shared_by: 1,
                p2p: false,
                h2d: d.h2d.link(),
                d2h: d.d2h.link(),
            },
            rates: Rates {
                matmul_gflops: Some(d.matmul_gflops),
                matmul_f16_gflops: d.matmul_f16_gflops,
                attention_gflops: d.attention_gflops,
                elementwise_gbps: Some(d.elementwise_gbps),
                matmul_curve: d.matmul_curve.clone(),
                attention_curve: d.attention_curve.clone(),
                matmul_surface: d.matmul_surface.clone(),
                attention_surface: d.attention_surface.clone(),
                matmul_surface_widths: d.surface_widths.clone(),
                attention_surface_widths: d.surface_widths.clone(),
                head_curve: d.head_curve.clone(),
            },
            compute_sharing: d.compute_sharing.clone(),
        })
        .collect();
    let profile = HostProfile {
        name: m.name.clone(),
        description: m.description.clone(),
        nodes: 1,
        host: HostSpec {
            name: m.host_name.clone(),
            memory_gbps: m.host_reduce_gbps,
            collective_overhead_us: m.collective_overhead_us.clone(),
        },
        devices,
        device_link: None,
        network: None,
    };
    profile.validate()?;
    Ok(profile)
}

/// TOML text of a calibrated profile, headed by comments saying where its numbers come from
/// (`note` is added as further comment lines, e.g. the date and the wgpar version).
pub fn calibrated_profile_toml(profile: &HostProfile, note: &str) -> Result<String, ProfileError> {
    let mut out = String::from(
        "# Calibrated profile written by `wgpar calibrate`.\n\
         # Source of every figure below: measurements of this machine (alpha-beta fits of\n\
         # host<->device copy sweeps, matmul / element-wise kernel rates, host reduce rate),\n\
         # not public specifications.\n",
    );
    for line in note.lines() {
        out.push_str("# ");
        out.push_str(line);
        out.push('\n');
    }
    out.push('\n');
    out.push_str(&profile.to_toml_string()?);
    Ok(out)
}

/// Writes [`calibrated_profile_toml`] to `path`.
pub fn write_calibrated_profile(
    profile: &HostProfile,
    note: &str,
    path: impl AsRef<Path>,
) -> Result<(), ProfileError> {
    let path = path.as_ref();
    std::fs::write(path, calibrated_profile_toml(profile, note)?).map_err(|source| {
        ProfileError::Io {
            path: path.to_owned(),
            source,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::fit_alpha_beta;

    fn device(name: &str, beta: f64) -> MeasuredDevice {
        let fit = fit_alpha_beta(&[
            (1_000_000, (10.0 + 1e6 / (beta * 1e3)) * 1e-6),
            (2_000_000, (10.0 + 2e6 / (beta * 1e3)) * 1e-6),
        ])
        .unwrap();
        MeasuredDevice {
            name: name.into(),
            count: 1,
            memory_bytes: 1 << 30,
            h2d: fit,
            d2h: fit,
            matmul_gflops: 2000.0,
            matmul_f16_gflops: None,
            attention_gflops: Some(800.0),
            elementwise_gbps: 300.0,
            launch_overhead_us: 4.0,
            submit_overhead_us: 150.0,
            matmul_curve: Vec::new(),
            attention_curve: Vec::new(),
            matmul_surface: Vec::new(),
            attention_surface: Vec::new(),
            surface_widths: Vec::new(),
            head_curve: Vec::new(),
            compute_sharing: None,
        }
    }

    #[test]
    fn measurements_become_a_valid_profile_that_reloads() {
        let m = MachineMeasurement {
            name: "this-machine".into(),
            description: "test".into(),
            host_name: "cpu".into(),
            host_reduce_gbps: 20.0,
            collective_overhead_us: vec![50.0],
            devices: vec![device("a", 25.0), device("b", 12.5)],
        };
        let p = calibrated_profile(&m).unwrap();
        assert_eq!(p.device_count(), 2);
        assert!((p.device(1).unwrap().host_link.h2d.beta_gbps - 12.5).abs() < 1e-9);
        assert_eq!(p.devices[0].f32_tflops, 2.0);
        assert_eq!(p.devices[0].f16_tflops, 2.0);
        assert_eq!(p.devices[0].rates.attention_gflops, Some(800.0));
        assert_eq!(p.devices[0].submit_overhead_us, Some(150.0));
        assert!(!p.lacks_submit_overhead());
        let text = calibrated_profile_toml(&p, "2026-01-01, wgpar 0.1.0").unwrap();
        assert!(text.starts_with("# Calibrated profile"));
        assert!(text.contains("# 2026-01-01, wgpar 0.1.0\n"));
        assert_eq!(HostProfile::from_toml_str(&text, "cal.toml").unwrap(), p);
    }

    #[test]
    fn shared_virtual_devices_become_one_group_with_curves() {
        let mut d = device("llvmpipe", 5.0);
        d.count = 4;
        d.matmul_curve = vec![[0.5, 1.0], [20.0, 8.0]];
        d.compute_sharing = Some(ComputeSharing {
            shared_by: 4,
            slowdown: vec![1.0, 1.8, 2.7, 3.6],
            slowdown_curve: vec![
                vec![0.5, 1.0, 1.2, 1.9, 2.6],
                vec![40.0, 1.0, 1.9, 2.8, 3.7],
            ],
        });
        let m = MachineMeasurement {
            name: "this-machine".into(),
            description: "test".into(),
            host_name: "cpu".into(),
            host_reduce_gbps: 2.0,
            collective_overhead_us: Vec::new(),
            devices: vec![d],
        };
        let p = calibrated_profile(&m).unwrap();
        assert_eq!((p.devices.len(), p.device_count()), (1, 4));
        assert_eq!(p.compute_pool_of(3).map(|(pool, _)| pool), Some(0));
        let text = calibrated_profile_toml(&p, "").unwrap();
        assert_eq!(HostProfile::from_toml_str(&text, "cal.toml").unwrap(), p);
        // Four devices need four slowdown entries.
        let mut bad = m.clone();
        if let Some(s) = bad.devices[0].compute_sharing.as_mut() {
            s.slowdown.pop();
        }
        let err = calibrated_profile(&bad).unwrap_err();
        assert_eq!(err.field(), Some("devices[0].compute_sharing.slowdown"));
    }

    #[test]
    fn bad_measurement_is_rejected() {
        let mut d = device("a", 25.0);
        d.elementwise_gbps = 0.0;
        let m = MachineMeasurement {
            name: "x".into(),
            description: String::new(),
            host_name: "cpu".into(),
            host_reduce_gbps: 20.0,
            collective_overhead_us: Vec::new(),
            devices: vec![d],
        };
        let err = calibrated_profile(&m).unwrap_err();
        assert_eq!(err.field(), Some("devices[0].memory_gbps"));
    }
}

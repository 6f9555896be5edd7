//! Host profiles: the devices of a machine and the links between them (`hosts/*.toml`).
//!
//! Units are in the field names: `_us` microseconds, `_gbps` gigabytes per second with
//! GB = 1e9 bytes (as nccl-tests counts), `_tflops` / `_gflops` 1e12 / 1e9 FLOP/s. The format is
//! documented with an example in `docs/PROJECTION.md`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::locate::FieldPath;
use super::profile_error::ProfileError;
use super::rules::{self, Violation};

/// A machine (or a cluster of identical machines) as the projection sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostProfile {
    /// Short name, e.g. `pcie4-2gpu`.
    pub name: String,
    /// One line about the machine.
    #[serde(default)]
    pub description: String,
    /// Number of identical nodes; each holds every device group listed in `devices`.
    pub nodes: u32,
    /// The host CPU and its memory.
    pub host: HostSpec,
    /// Device groups of one node; device indices count through the groups in order, then
    /// through the nodes.
    pub devices: Vec<DeviceSpec>,
    /// Direct device-to-device links inside a node (NVLink through NVSwitch); absent when the
    /// devices can only talk through the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_link: Option<NamedLink>,
    /// Network between nodes; required when `nodes > 1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NamedLink>,
}

/// The host CPU side.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSpec {
    /// CPU and memory, e.g. `Ryzen 9 7950X, DDR5-5200 dual channel`.
    pub name: String,
    /// Host memory bandwidth available to the host reduce, GB/s.
    pub memory_gbps: f64,
    /// Fixed host cost of one host-staged collective with 2, 3, ... participants, beyond its
    /// copies and reduction (rendezvous of the ranks, submissions, buffer mapping), in
    /// microseconds; the last entry also applies to more participants. Measured by
    /// `wgpar calibrate`; empty (the default) counts no such cost.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub collective_overhead_us: Vec<f64>,
}

impl HostSpec {
    /// [`HostSpec::collective_overhead_us`] for `participants` devices (0 for fewer than 2).
    pub fn collective_overhead(&self, participants: usize) -> f64 {
        if participants < 2 {
            return 0.0;
        }
        let i = (participants - 2).min(self.collective_overhead_us.len().saturating_sub(1));
        self.collective_overhead_us.get(i).copied().unwrap_or(0.0)
    }
}

/// A group of identical devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    /// Marketing name, e.g. `NVIDIA GeForce RTX 4090`.
    pub name: String,
    /// How many of them each node has.
    pub count: u32,
    /// Device memory, bytes.
    pub memory_bytes: u64,
    /// Device memory bandwidth, GB/s.
    pub memory_gbps: f64,
    /// Peak f32 rate of the shader cores (what WGSL compute uses), TFLOP/s.
    pub f32_tflops: f64,
    /// Peak f16 rate of the shader cores, TFLOP/s.
    pub f16_tflops: f64,
    /// Peak dense f16/bf16 rate of the matrix units (NVIDIA tensor cores, FP32 accumulate),
    /// TFLOP/s; absent on devices without them. What an engine that computes on tensor cores
    /// (cuBLAS) reaches a fraction of; wgpar's WGSL kernels do not use them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub f16_tensor_tflops: Option<f64>,
    /// Fixed cost of one kernel dispatch, microseconds.
    pub launch_overhead_us: f64,
    /// Fixed host cost of one submission, microseconds: recording a command buffer,
    /// submitting it and waiting until the host sees it done, beyond its dispatches' own
    /// `launch_overhead_us`. Every compute span an engine records is one submission and its
    /// wait, so the projection charges this once per compute span. Measured by `wgpar
    /// calibrate` (fitted with `launch_overhead_us` from submissions of 1 to 64 dispatches);
    /// absent (profiles calibrated before it was measured, spec-sheet profiles): 0, and
    /// `wgpar project` says so for a calibrated profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submit_overhead_us: Option<f64>,
    /// The link between this device and host memory.
    pub host_link: HostLinkSpec,
    /// Measured kernel rates (filled by `wgpar calibrate`); preferred over the peaks above.
    #[serde(default, skip_serializing_if = "Rates::is_empty")]
    pub rates: Rates,
    /// Devices of the group that run their kernels on one shared processor (absent: each
    /// device has its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_sharing: Option<ComputeSharing>,
}

/// Devices that compute on one shared processor: several virtual devices on one adapter, or a
/// CPU driver such as lavapipe whose devices all draw on the same cores.
///
/// When `k` devices of one processor have compute spans running at the same time, each runs
/// `slowdown[k - 1]` times slower than alone (with an empty list, `k` times slower: equal
/// shares of a processor that any one device saturates).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeSharing {
    /// How many consecutive devices of the group share one processor.
    pub shared_by: u32,
    /// Measured slowdown with 1, 2, ..., `shared_by` devices computing at once (the first
    /// entry is 1); empty for equal shares.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slowdown: Vec<f64>,
    /// Measured slowdown by the arithmetic intensity of the slowed-down work: rows
    /// `[flops per byte, slowdown with 1 busy, 2 busy, ..., shared_by busy]`, increasing
    /// intensity. Preferred over `slowdown` for work whose intensity is known: on a CPU driver a
    /// decode step (tiny dispatches, mostly thread hand-offs) shares the cores very differently
    /// from a prefill step (long, compute-bound dispatches).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slowdown_curve: Vec<Vec<f64>>,
}

impl ComputeSharing {
    /// How many times slower each of `active` devices computes than one device alone.
    pub fn slowdown(&self, active: usize) -> f64 {
        if active <= 1 {
            return 1.0;
        }
        match self.slowdown.get(active - 1) {
            Some(&s) => s,
            // More devices than measured (cannot happen for a valid profile): equal shares.
            None => active as f64,
        }
    }

    /// How many times slower work of `intensity` flops per byte runs while `active` devices
    /// compute: `slowdown_curve` interpolated like [`rate_at`] (linear in log intensity, held
    /// beyond the ends), else [`slowdown`](Self::slowdown).
    pub fn slowdown_at(&self, active: usize, intensity: f64) -> f64 {
        if active <= 1 {
            return 1.0;
        }
        let column: Vec<[f64; 2]> = self
            .slowdown_curve
            .iter()
            .filter_map(|row| Some([*row.first()?, *row.get(active)?]))
            .collect();
        if column.len() != self.slowdown_curve.len() {
            return self.slowdown(active);
        }
        rate_at(&column, intensity).unwrap_or_else(|| self.slowdown(active))
    }
}

/// Measured per-family kernel rates; each replaces the matching peak in the roofline.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rates {
    /// Achieved f32 matmul rate, GFLOP/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matmul_gflops: Option<f64>,
    /// Achieved f16 matmul rate, GFLOP/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matmul_f16_gflops: Option<f64>,
    /// Achieved attention rate, GFLOP/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_gflops: Option<f64>,
    /// Achieved streaming bandwidth of element-wise kernels, GB/s (replaces `memory_gbps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elementwise_gbps: Option<f64>,
    /// Achieved f32 matmul-family rate as a function of arithmetic intensity: points
    /// `[flops per byte, GFLOP/s]` with increasing intensity. Preferred over `matmul_gflops`;
    /// see [`rate_at`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matmul_curve: Vec<[f64; 2]>,
    /// Achieved attention-family rate as a function of arithmetic intensity, like
    /// `matmul_curve`; preferred over `attention_gflops`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attention_curve: Vec<[f64; 2]>,
    /// Achieved f32 matmul-family rate by arithmetic intensity *and* block width: one curve
    /// per measured block width, each a list of points `[flops per byte, MFLOP per dispatch,
    /// GFLOP/s]` with increasing intensity. Preferred over `matmul_curve`; read by block
    /// width where `matmul_surface_widths` names each curve's ([`rate_on_surface_at_width`]),
    /// else by work per dispatch ([`rate_on_surface`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matmul_surface: Vec<Vec<[f64; 3]>>,
    /// Attention-family rate by intensity and block width, like `matmul_surface`;
    /// preferred over `attention_curve`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attention_surface: Vec<Vec<[f64; 3]>>,
    /// The block width (hidden size of a whole block) each curve of `matmul_surface` was
    /// measured at, in the curves' order. Empty where unknown: the curves are then told apart
    /// by work per dispatch alone. See [`rate_on_surface_at_width`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matmul_surface_widths: Vec<f64>,
    /// The block width of each curve of `attention_surface`, like `matmul_surface_widths`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attention_surface_widths: Vec<f64>,
    /// Achieved f32 rate of the model's final norm and LM head by arithmetic intensity,
    /// `[flops per byte, GFLOP/s]` with increasing intensity, net of dispatch costs: one
    /// large matrix over the vocabulary, which streams at a rate of its own. Prices the head
    /// part of a compute span ([`crate::trace::Span::head`]); spans without one, or profiles
    /// without this curve, price the head with the rest of the span.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub head_curve: Vec<[f64; 2]>,
}

/// Rate of a measured curve at arithmetic intensity `intensity` (flops per byte):
/// piecewise linear in log(intensity) between points, the end values beyond them.
///
/// A curve replaces the single rate of a roofline because achieved rates depend on the shape:
/// a decode step (a handful of rows per matmul) runs far below the rate of a prefill step, and
/// the rows per matmul are what sets the intensity. `None` for an empty curve.
pub fn rate_at(curve: &[[f64; 2]], intensity: f64) -> Option<f64> {
    let (first, last) = (curve.first()?, curve.last()?);
    if intensity.is_nan() || intensity <= first[0] {
        return Some(first[1]);
    }
    if intensity >= last[0] {
        return Some(last[1]);
    }
    let i = curve.partition_point(|p| p[0] <= intensity);
    let (a, b) = (curve[i - 1], curve[i]);
    let w = (intensity.ln() - a[0].ln()) / (b[0].ln() - a[0].ln());
    Some(a[1] + w * (b[1] - a[1]))
}

/// Rate of a measured surface (see [`Rates::matmul_surface`]) for work of `intensity` flops
/// per byte done in dispatches of `mflop_per_dispatch` MFLOP each.
///
/// Each curve of the surface is one block width measured at several step shapes. At the
/// span's intensity every curve gives a rate and a work per dispatch (both interpolated like
/// [`rate_at`]: linear in log intensity, the work per dispatch in log scale too, held beyond
/// the ends); the rate is then interpolated between the curves linearly in log work per
/// dispatch, held at the narrowest and widest curve beyond them.
///
/// Why a second axis: at equal intensity a narrow block (few columns per matmul, few
/// workgroups per dispatch) runs below a wide one: on a GPU too few workgroups leave compute
/// units idle, on a CPU driver the fixed cost of spreading a dispatch over threads is not
/// paid back. Intensity alone cannot tell a narrow model's prefill from a wide model's decode.
/// `None` for an empty surface.
pub fn rate_on_surface(
    surface: &[Vec<[f64; 3]>],
    intensity: f64,
    mflop_per_dispatch: f64,
) -> Option<f64> {
    let at: Vec<(f64, f64)> = surface
        .iter()
        .filter_map(|curve| {
            let log_work: Vec<[f64; 2]> = curve.iter().map(|p| [p[0], p[1].ln()]).collect();
            Some((
                rate_at(&log_work, intensity)?,
                surface_curve_rate(curve, intensity)?,
            ))
        })
        .collect();
    across_curves(at, mflop_per_dispatch.ln())
}

/// Rate of a measured surface whose curves carry the block width they were measured at
/// (`widths[k]` for `surface[k]`), for work of `intensity` flops per byte done by blocks
/// `width` wide (see [`crate::trace::Span::block_width`]).
///
/// Every curve gives its rate at the intensity (as in [`rate_at`]); the rate is then
/// interpolated between the curves linearly in log width, held at the narrowest and widest
/// curve beyond them.
///
/// Why width rather than work per dispatch: the curves are one architecture's blocks, and
/// another architecture at the same width does more or less work per dispatch (GPT-2's MLP
/// is 4x its width, a Llama's about 2.7x in three matrices) without its kernels running at
/// another width's rate: the workgroups a dispatch spreads over follow its matrices' width.
/// `None` for an empty surface or when `widths` does not name every curve.
pub fn rate_on_surface_at_width(
    surface: &[Vec<[f64; 3]>],
    widths: &[f64],
    intensity: f64,
    width: f64,
) -> Option<f64> {
    if widths.len() != surface.len() {
        return None;
    }
    let at: Vec<(f64, f64)> = surface
        .iter()
        .zip(widths)
        .filter_map(|(curve, w)| Some((w.ln(), surface_curve_rate(curve, intensity)?)))
        .collect();
    across_curves(at, width.ln())
}

/// Rate of one curve of a surface at `intensity`, as [`rate_at`] reads a curve.
fn surface_curve_rate(curve: &[[f64; 3]], intensity: f64) -> Option<f64> {
    let rate: Vec<[f64; 2]> = curve.iter().map(|p| [p[0], p[2]]).collect();
    rate_at(&rate, intensity)
}

/// Interpolates `(key, rate)` points of several curves at `key`: linearly between the two
/// curves around it, held at the ends; the mean of two curves at one key. `None` when empty.
fn across_curves(mut at: Vec<(f64, f64)>, w: f64) -> Option<f64> {
    at.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (first, last) = (*at.first()?, *at.last()?);
    if w.is_nan() || w <= first.0 {
        return Some(first.1);
    }
    if w >= last.0 {
        return Some(last.1);
    }
    let i = at.partition_point(|p| p.0 <= w);
    let (a, b) = (at[i - 1], at[i]);
    // Two curves at the same key (cannot bracket `w` strictly): their mean.
    if b.0 - a.0 <= f64::EPSILON {
        return Some((a.1 + b.1) / 2.0);
    }
    Some(a.1 + (w - a.0) / (b.0 - a.0) * (b.1 - a.1))
}

impl Rates {
    /// True when no rate is set.
    pub fn is_empty(&self) -> bool {
        self == &Rates::default()
    }
}

fn check_curve(path: &FieldPath, curve: &[[f64; 2]]) -> Result<(), Violation> {
    for (i, p) in curve.iter().enumerate() {
        rules::intensity(&path.index(i).index(0), p[0])?;
        rules::gflops(&path.index(i).index(1), p[1])?;
        if i > 0 && p[0] <= curve[i - 1][0] {
            return Err(Violation::new(
                path.index(i),
                format!("[{}, {}]", p[0], p[1]),
                "curve points must have strictly increasing intensity",
            ));
        }
    }
    Ok(())
}

fn check_surface(path: &FieldPath, surface: &[Vec<[f64; 3]>]) -> Result<(), Violation> {
    for (k, curve) in surface.iter().enumerate() {
        let cp = path.index(k);
        if curve.is_empty() {
            return Err(Violation::new(
                cp,
                "[]",
                "a curve of the surface needs at least one point",
            ));
        }
        for (i, p) in curve.iter().enumerate() {
            rules::intensity(&cp.index(i).index(0), p[0])?;
            rules::mflop_per_dispatch(&cp.index(i).index(1), p[1])?;
            rules::gflops(&cp.index(i).index(2), p[2])?;
            if i > 0 && p[0] <= curve[i - 1][0] {
                return Err(Violation::new(
                    cp.index(i),
                    format!("[{}, {}, {}]", p[0], p[1], p[2]),
                    "curve points must have strictly increasing intensity",
                ));
            }
        }
    }
    Ok(())
}

/// Widths of a surface's curves: none, or one per curve, each a valid block width.
fn check_surface_widths(path: &FieldPath, widths: &[f64], curves: usize) -> Result<(), Violation> {
    if !widths.is_empty() && widths.len() != curves {
        return Err(Violation::new(
            path.clone(),
            format!("{} widths for {curves} curves", widths.len()),
            "needs one width per curve of the surface, in the curves' order, or none",
        ));
    }
    for (i, &w) in widths.iter().enumerate() {
        rules::block_width(&path.index(i), w)?;
    }
    Ok(())
}

/// A device's link to host memory, one alpha-beta model per direction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostLinkSpec {
    /// What the link is, e.g. `PCIe 4.0 x16` or `unified memory`.
    pub name: String,
    /// How many consecutive devices of the group sit behind one upstream link (a PCIe switch,
    /// or host memory itself): 1 when every device has its own lanes to the host. Transfers in
    /// the same direction through one upstream link run one at a time; others overlap.
    pub shared_by: u32,
    /// Whether devices of this group can copy to each other directly over PCIe (peer to peer,
    /// as NCCL's P2P transport does); false for GeForce cards, whose driver does not allow it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub p2p: bool,
    /// Host to device.
    pub h2d: LinkSpec,
    /// Device to host.
    pub d2h: LinkSpec,
}

/// Alpha-beta model of one link direction: a transfer of `n` bytes takes
/// `alpha_us + n / (beta_gbps * 1e3)` microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    /// Latency, microseconds.
    pub alpha_us: f64,
    /// Bandwidth, GB/s.
    pub beta_gbps: f64,
}

impl LinkSpec {
    /// Microseconds to move `bytes` over this link.
    pub fn time_us(&self, bytes: f64) -> f64 {
        self.alpha_us + bytes / (self.beta_gbps * 1e3)
    }
}

/// A named alpha-beta link (device-to-device fabric or inter-node network).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedLink {
    /// What it is, e.g. `NVLink3 via NVSwitch` or `InfiniBand HDR 200 Gb/s`.
    pub name: String,
    /// Latency per message (per ring step for ring collectives), microseconds.
    pub alpha_us: f64,
    /// Bandwidth per device (device link) or per network interface (network) and direction,
    /// GB/s.
    pub beta_gbps: f64,
    /// Device link only: the switch reduces in the fabric (NVLink SHARP, NCCL's NVLS
    /// algorithm; third-generation NVSwitch, H100 and later).
    #[serde(default, skip_serializing_if = "is_false")]
    pub nvls: bool,
    /// Network only: interfaces per node (one per GPU on a DGX SuperPOD); each carries
    /// `beta_gbps`. Absent: one per node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nics_per_node: Option<u32>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl NamedLink {
    /// The link's alpha-beta model.
    pub fn link(&self) -> LinkSpec {
        LinkSpec {
            alpha_us: self.alpha_us,
            beta_gbps: self.beta_gbps,
        }
    }
}

impl HostProfile {
    /// Reads and validates a profile file.
    pub fn load(path: impl AsRef<Path>) -> Result<HostProfile, ProfileError> {
        let path = path.as_ref();
        let text =
            crate::files::read_text(path, crate::files::PROFILE_LIMIT).map_err(|source| {
                ProfileError::Io {
                    path: path.to_owned(),
                    source,
                }
            })?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// Parses and validates profile text; `file` names the source in errors.
    pub fn from_toml_str(text: &str, file: &str) -> Result<HostProfile, ProfileError> {
        rules::parse_checked(text, file, HostProfile::check)
    }

    /// Checks value ranges of a profile built in code (no file, so no line numbers).
    pub fn validate(&self) -> Result<(), ProfileError> {
        self.check()
            .map_err(|v| rules::unlocated(&format!("<profile {}>", self.name), v))
    }

    /// The profile as TOML text (without source comments).
    pub fn to_toml_string(&self) -> Result<String, ProfileError> {
        toml::to_string(self).map_err(|e| ProfileError::Serialize {
            name: self.name.clone(),
            message: e.to_string(),
        })
    }

    /// Devices in one node.
    pub fn devices_per_node(&self) -> usize {
        self.devices.iter().map(|d| d.count as usize).sum()
    }

    /// Devices in all nodes.
    pub fn device_count(&self) -> usize {
        self.devices_per_node() * self.nodes as usize
    }

    /// The spec of device `index` (counting through groups, then nodes).
    pub fn device(&self, index: usize) -> Option<&DeviceSpec> {
        if index >= self.device_count() {
            return None;
        }
        let mut local = index % self.devices_per_node();
        for group in &self.devices {
            if local < group.count as usize {
                return Some(group);
            }
            local -= group.count as usize;
        }
        None
    }

    /// The node that holds device `index`.
    pub fn node_of(&self, index: usize) -> usize {
        index / self.devices_per_node().max(1)
    }

    /// Number of the upstream host link device `index` uses; devices with the same number
    /// share bandwidth (see [`HostLinkSpec::shared_by`]).
    pub fn uplink_of(&self, index: usize) -> Option<usize> {
        if index >= self.device_count() {
            return None;
        }
        let per_node = self.devices_per_node();
        let mut local = index % per_node;
        // Uplinks are numbered through the groups of a node, then through the nodes.
        let mut uplinks_before = 0;
        let uplinks_in =
            |g: &DeviceSpec| (g.count as usize).div_ceil(g.host_link.shared_by as usize);
        let per_node_uplinks: usize = self.devices.iter().map(uplinks_in).sum();
        for group in &self.devices {
            if local < group.count as usize {
                let slot = local / group.host_link.shared_by as usize;
                return Some(self.node_of(index) * per_node_uplinks + uplinks_before + slot);
            }
            local -= group.count as usize;
            uplinks_before += uplinks_in(group);
        }
        None
    }

    /// Number of the shared processor device `index` computes on, when its group has
    /// [`ComputeSharing`]; devices with the same number slow each other down.
    pub fn compute_pool_of(&self, index: usize) -> Option<(usize, &ComputeSharing)> {
        if index >= self.device_count() {
            return None;
        }
        let per_node = self.devices_per_node();
        let mut local = index % per_node;
        // Numbered like uplinks: through the groups of a node (one number per device without
        // sharing, so numbers stay unique), then through the nodes.
        let pools_in = |g: &DeviceSpec| {
            let by = g
                .compute_sharing
                .as_ref()
                .map_or(1, |c| c.shared_by as usize);
            (g.count as usize).div_ceil(by)
        };
        let per_node_pools: usize = self.devices.iter().map(pools_in).sum();
        let mut before = 0;
        for group in &self.devices {
            if local < group.count as usize {
                let sharing = group.compute_sharing.as_ref()?;
                let slot = local / sharing.shared_by as usize;
                return Some((
                    self.node_of(index) * per_node_pools + before + slot,
                    sharing,
                ));
            }
            local -= group.count as usize;
            before += pools_in(group);
        }
        None
    }

    /// Whether the profile holds measurements of wgpar itself (written by `wgpar calibrate`):
    /// measured kernel rates or a measured collective cost. An engine that says its kernels are
    /// what calibration measures (`calibrated = true`) then uses them as they are.
    pub fn is_measured(&self) -> bool {
        !self.host.collective_overhead_us.is_empty()
            || self.devices.iter().any(|d| !d.rates.is_empty())
    }

    /// Whether this is a calibrated profile written before `wgpar calibrate` measured the
    /// fixed cost of a submission (`submit_overhead_us` absent on some device group): its
    /// projections charge 0 there, so short steps come out fast.
    pub fn lacks_submit_overhead(&self) -> bool {
        self.is_measured() && self.devices.iter().any(|d| d.submit_overhead_us.is_none())
    }

    /// Every rule a profile must satisfy; the first broken one is returned.
    pub(crate) fn check(&self) -> Result<(), Violation> {
        let root = FieldPath::root();
        rules::non_empty(&root.key("name"), &self.name)?;
        rules::at_least_one(&root.key("nodes"), self.nodes as u64)?;
        if self.nodes > 100_000 {
            return Err(Violation::new(
                root.key("nodes"),
                self.nodes,
                "must be at most 100000",
            ));
        }
        let host = root.key("host");
        rules::non_empty(&host.key("name"), &self.host.name)?;
        rules::bandwidth_gbps(&host.key("memory_gbps"), self.host.memory_gbps)?;
        for (i, &v) in self.host.collective_overhead_us.iter().enumerate() {
            rules::latency_us(&host.key("collective_overhead_us").index(i), v)?;
        }
        if self.devices.is_empty() {
            return Err(Violation::new(
                root.key("devices"),
                "[]",
                "a profile needs at least one [[devices]] group",
            ));
        }
        for (i, d) in self.devices.iter().enumerate() {
            check_device(&root.key("devices").index(i), d)?;
        }
        if self.devices_per_node() > 100_000 {
            return Err(Violation::new(
                root.key("devices"),
                self.devices_per_node(),
                "at most 100000 devices per node",
            ));
        }
        if let Some(dl) = &self.device_link {
            let p = root.key("device_link");
            check_named(&p, dl)?;
            if dl.nics_per_node.is_some() {
                return Err(Violation::new(
                    p.key("nics_per_node"),
                    dl.nics_per_node.unwrap_or(0),
                    "belongs in [network], not [device_link]",
                ));
            }
        }
        match &self.network {
            Some(net) => {
                let p = root.key("network");
                check_named(&p, net)?;
                if net.nvls {
                    return Err(Violation::new(
                        p.key("nvls"),
                        true,
                        "an in-switch reduction (NVLS) belongs to [device_link], not [network]",
                    ));
                }
                if let Some(n) = net.nics_per_node {
                    rules::at_least_one(&p.key("nics_per_node"), n as u64)?;
                }
            }
            None if self.nodes > 1 => {
                return Err(Violation::new(
                    root.key("nodes"),
                    self.nodes,
                    "more than one node needs a [network] table",
                ))
            }
            None => {}
        }
        Ok(())
    }
}

fn check_device(p: &FieldPath, d: &DeviceSpec) -> Result<(), Violation> {
    rules::non_empty(&p.key("name"), &d.name)?;
    rules::at_least_one(&p.key("count"), d.count as u64)?;
    rules::memory_bytes(&p.key("memory_bytes"), d.memory_bytes)?;
    rules::bandwidth_gbps(&p.key("memory_gbps"), d.memory_gbps)?;
    rules::tflops(&p.key("f32_tflops"), d.f32_tflops)?;
    rules::tflops(&p.key("f16_tflops"), d.f16_tflops)?;
    if let Some(t) = d.f16_tensor_tflops {
        rules::tflops(&p.key("f16_tensor_tflops"), t)?;
    }
    rules::latency_us(&p.key("launch_overhead_us"), d.launch_overhead_us)?;
    if let Some(v) = d.submit_overhead_us {
        rules::latency_us(&p.key("submit_overhead_us"), v)?;
    }
    let l = p.key("host_link");
    rules::non_empty(&l.key("name"), &d.host_link.name)?;
    rules::at_least_one(&l.key("shared_by"), d.host_link.shared_by as u64)?;
    check_link(&l.key("h2d"), &d.host_link.h2d)?;
    check_link(&l.key("d2h"), &d.host_link.d2h)?;
    check_rates(&p.key("rates"), &d.rates)?;
    if let Some(c) = &d.compute_sharing {
        check_sharing(&p.key("compute_sharing"), c, d.count)?;
    }
    Ok(())
}

/// A device group's measured rates, curves and surfaces.
fn check_rates(r: &FieldPath, rates: &Rates) -> Result<(), Violation> {
    for (name, v) in [
        ("matmul_gflops", rates.matmul_gflops),
        ("matmul_f16_gflops", rates.matmul_f16_gflops),
        ("attention_gflops", rates.attention_gflops),
    ] {
        if let Some(v) = v {
            rules::gflops(&r.key(name), v)?;
        }
    }
    if let Some(v) = rates.elementwise_gbps {
        rules::bandwidth_gbps(&r.key("elementwise_gbps"), v)?;
    }
    check_curve(&r.key("matmul_curve"), &rates.matmul_curve)?;
    check_curve(&r.key("attention_curve"), &rates.attention_curve)?;
    check_curve(&r.key("head_curve"), &rates.head_curve)?;
    check_surface(&r.key("matmul_surface"), &rates.matmul_surface)?;
    check_surface(&r.key("attention_surface"), &rates.attention_surface)?;
    check_surface_widths(
        &r.key("matmul_surface_widths"),
        &rates.matmul_surface_widths,
        rates.matmul_surface.len(),
    )?;
    check_surface_widths(
        &r.key("attention_surface_widths"),
        &rates.attention_surface_widths,
        rates.attention_surface.len(),
    )
}

/// A group's compute sharing: at most `count` devices share a processor, with one slowdown
/// per sharer, and curve rows of increasing intensity.
fn check_sharing(cp: &FieldPath, c: &ComputeSharing, count: u32) -> Result<(), Violation> {
    rules::at_least_one(&cp.key("shared_by"), c.shared_by as u64)?;
    if c.shared_by > count {
        return Err(Violation::new(
            cp.key("shared_by"),
            c.shared_by,
            "cannot exceed the group's device count: only devices of this group can share \
             its processor",
        ));
    }
    if !c.slowdown.is_empty() && c.slowdown.len() != c.shared_by as usize {
        return Err(Violation::new(
            cp.key("slowdown"),
            format!("{} entries", c.slowdown.len()),
            "needs one entry per device sharing the processor",
        ));
    }
    for (k, &s) in c.slowdown.iter().enumerate() {
        rules::slowdown(&cp.key("slowdown").index(k), s)?;
    }
    let curve = cp.key("slowdown_curve");
    for (i, row) in c.slowdown_curve.iter().enumerate() {
        let rp = curve.index(i);
        if row.len() != c.shared_by as usize + 1 {
            return Err(Violation::new(
                rp,
                format!("{} entries", row.len()),
                "needs the intensity, then one slowdown per device sharing the processor",
            ));
        }
        rules::intensity(&rp.index(0), row[0])?;
        if i > 0 && row[0] <= c.slowdown_curve[i - 1][0] {
            return Err(Violation::new(
                rp.index(0),
                row[0],
                "curve rows must have strictly increasing intensity",
            ));
        }
        for (k, &s) in row.iter().enumerate().skip(1) {
            rules::slowdown(&rp.index(k), s)?;
        }
    }
    Ok(())
}

fn check_named(path: &FieldPath, l: &NamedLink) -> Result<(), Violation> {
    rules::non_empty(&path.key("name"), &l.name)?;
    check_link(path, &l.link())
}

fn check_link(path: &FieldPath, l: &LinkSpec) -> Result<(), Violation> {
    rules::latency_us(&path.key("alpha_us"), l.alpha_us)?;
    rules::bandwidth_gbps(&path.key("beta_gbps"), l.beta_gbps)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = r#"
name = "t"
nodes = 2

[host]
name = "cpu"
memory_gbps = 50

[[devices]]
name = "big"
count = 1
memory_bytes = 1000
memory_gbps = 100
f32_tflops = 1
f16_tflops = 2
launch_overhead_us = 0
[devices.host_link]
name = "pcie"
shared_by = 1
h2d = { alpha_us = 1, beta_gbps = 10 }
d2h = { alpha_us = 2, beta_gbps = 20 }

[[devices]]
name = "small"
count = 2
memory_bytes = 1000
memory_gbps = 10
f32_tflops = 1
f16_tflops = 1
launch_overhead_us = 1
[devices.host_link]
name = "pcie"
shared_by = 2
h2d = { alpha_us = 1, beta_gbps = 10 }
d2h = { alpha_us = 1, beta_gbps = 10 }
[devices.rates]
matmul_gflops = 500

[network]
name = "ib"
alpha_us = 20
beta_gbps = 22.5
"#;

    #[test]
    fn device_indices_walk_groups_then_nodes() {
        let p = HostProfile::from_toml_str(OK, "ok.toml").unwrap();
        assert_eq!((p.devices_per_node(), p.device_count()), (3, 6));
        let names: Vec<&str> = (0..6).map(|i| p.device(i).unwrap().name.as_str()).collect();
        assert_eq!(names, ["big", "small", "small", "big", "small", "small"]);
        assert!(p.device(6).is_none());
        assert_eq!((p.node_of(2), p.node_of(3)), (0, 1));
        // Group "big" has one uplink; the two "small" devices share one.
        let uplinks: Vec<usize> = (0..6).map(|i| p.uplink_of(i).unwrap()).collect();
        assert_eq!(uplinks, [0, 1, 1, 2, 3, 3]);
        assert!(p.uplink_of(6).is_none());
        assert_eq!(p.devices[1].rates.matmul_gflops, Some(500.0));
    }

    #[test]
    fn rate_curve_interpolates_in_log_intensity_and_clamps() {
        let c = [[1.0, 2.0], [4.0, 6.0], [16.0, 8.0]];
        assert_eq!(rate_at(&c, 0.1), Some(2.0));
        assert_eq!(rate_at(&c, f64::NAN), Some(2.0));
        assert_eq!(rate_at(&c, 1.0), Some(2.0));
        // 2 is halfway between 1 and 4 in log scale.
        assert!((rate_at(&c, 2.0).unwrap() - 4.0).abs() < 1e-12);
        assert_eq!(rate_at(&c, 4.0), Some(6.0));
        assert!((rate_at(&c, 8.0).unwrap() - 7.0).abs() < 1e-12);
        assert_eq!(rate_at(&c, 1e9), Some(8.0));
        assert_eq!(rate_at(&[], 3.0), None);
    }

    #[test]
    fn compute_pools_and_their_rules() {
        let shared = OK.replace(
            "[devices.rates]\nmatmul_gflops = 500",
            "[devices.rates]\nmatmul_gflops = 500\nmatmul_curve = [[0.5, 100], [8, 500]]\n\
             [devices.compute_sharing]\nshared_by = 2\nslowdown = [1, 1.8]",
        );
        let p = HostProfile::from_toml_str(&shared, "s.toml").unwrap();
        // "big" computes alone (no pool); the two "small" devices share pool 1 on node 0 and
        // pool 3 on node 1.
        let pools: Vec<Option<usize>> = (0..6).map(|i| p.compute_pool_of(i).map(|x| x.0)).collect();
        assert_eq!(pools, [None, Some(1), Some(1), None, Some(3), Some(3)]);
        let sharing = p.compute_pool_of(1).unwrap().1;
        assert_eq!((sharing.slowdown(1), sharing.slowdown(2)), (1.0, 1.8));
        assert_eq!(
            p.devices[1].rates.matmul_curve,
            vec![[0.5, 100.0], [8.0, 500.0]]
        );
        let text = p.to_toml_string().unwrap();
        assert_eq!(HostProfile::from_toml_str(&text, "again.toml").unwrap(), p);

        let faster = shared.replace("slowdown = [1, 1.8]", "slowdown = [1, 0.5]");
        let err = HostProfile::from_toml_str(&faster, "f.toml").unwrap_err();
        assert_eq!(err.field(), Some("devices[1].compute_sharing.slowdown[1]"));
        let short = shared.replace("slowdown = [1, 1.8]", "slowdown = [1]");
        let err = HostProfile::from_toml_str(&short, "f.toml").unwrap_err();
        assert_eq!(err.field(), Some("devices[1].compute_sharing.slowdown"));
        let unsorted = shared.replace("[[0.5, 100], [8, 500]]", "[[8, 100], [0.5, 500]]");
        let err = HostProfile::from_toml_str(&unsorted, "u.toml").unwrap_err();
        assert_eq!(err.field(), Some("devices[1].rates.matmul_curve[1]"));
        // Collective overheads by participant count; the last entry covers more.
        let mut host = p.host.clone();
        assert_eq!(host.collective_overhead(2), 0.0);
        host.collective_overhead_us = vec![100.0, 150.0];
        assert_eq!(
            [1, 2, 3, 8].map(|n| host.collective_overhead(n)),
            [0.0, 100.0, 150.0, 150.0]
        );
        let neg = shared.replace(
            "memory_gbps = 50",
            "memory_gbps = 50\ncollective_overhead_us = [5, -1]",
        );
        let err = HostProfile::from_toml_str(&neg, "n.toml").unwrap_err();
        assert_eq!(err.field(), Some("host.collective_overhead_us[1]"));
        // Equal shares when no slowdown was measured.
        let equal = ComputeSharing {
            shared_by: 4,
            slowdown: Vec::new(),
            slowdown_curve: Vec::new(),
        };
        assert_eq!(equal.slowdown(3), 3.0);
        assert_eq!(equal.slowdown_at(3, 10.0), 3.0);
    }

    #[test]
    fn slowdown_by_intensity() {
        let shared = OK.replace(
            "[devices.rates]\nmatmul_gflops = 500",
            "[devices.rates]\nmatmul_gflops = 500\n\
             [devices.compute_sharing]\nshared_by = 2\nslowdown = [1, 1.8]\n\
             slowdown_curve = [[1, 1, 1.2], [4, 1, 2.0]]",
        );
        let p = HostProfile::from_toml_str(&shared, "s.toml").unwrap();
        let sharing = p.compute_pool_of(1).unwrap().1;
        assert_eq!(sharing.slowdown_at(1, 2.0), 1.0);
        // Held at the ends, linear in log intensity between rows: 2 is halfway from 1 to 4.
        assert_eq!(sharing.slowdown_at(2, 0.1), 1.2);
        assert!((sharing.slowdown_at(2, 2.0) - 1.6).abs() < 1e-12);
        assert_eq!(sharing.slowdown_at(2, 100.0), 2.0);
        // The list still answers for a count the rows do not cover.
        assert_eq!(sharing.slowdown_at(3, 2.0), sharing.slowdown(3));
        let text = p.to_toml_string().unwrap();
        assert_eq!(HostProfile::from_toml_str(&text, "again.toml").unwrap(), p);

        for (bad, field) in [
            (
                "[[1, 1, 1.2], [4, 1]]",
                "devices[1].compute_sharing.slowdown_curve[1]",
            ),
            (
                "[[1, 1, 0.9], [4, 1, 2]]",
                "devices[1].compute_sharing.slowdown_curve[0][2]",
            ),
            (
                "[[4, 1, 1.2], [1, 1, 2]]",
                "devices[1].compute_sharing.slowdown_curve[1][0]",
            ),
            (
                "[[0, 1, 1.2]]",
                "devices[1].compute_sharing.slowdown_curve[0][0]",
            ),
        ] {
            let text = shared.replace("[[1, 1, 1.2], [4, 1, 2.0]]", bad);
            let err = HostProfile::from_toml_str(&text, "bad.toml").unwrap_err();
            assert_eq!(err.field(), Some(field), "{bad}: {err}");
        }
    }

    #[test]
    fn toml_round_trip() {
        let p = HostProfile::from_toml_str(OK, "ok.toml").unwrap();
        let text = p.to_toml_string().unwrap();
        assert_eq!(HostProfile::from_toml_str(&text, "again.toml").unwrap(), p);
    }

    #[test]
    fn link_time() {
        let l = LinkSpec {
            alpha_us: 10.0,
            beta_gbps: 25.0,
        };
        // 1 MB at 25 GB/s is 40 us, plus 10 us latency.
        assert_eq!(l.time_us(1e6), 50.0);
    }

    #[test]
    fn rules_name_the_field() {
        let no_net = OK.replace("[network]", "[ignored]");
        let err = HostProfile::from_toml_str(&no_net, "n.toml").unwrap_err();
        // The [ignored] table is an unknown field at the top level.
        assert_eq!(err.field(), Some("ignored"));
        let one_node_no_net = OK
            .replace("nodes = 2", "nodes = 1")
            .split("[network]")
            .next()
            .unwrap()
            .to_owned();
        assert!(HostProfile::from_toml_str(&one_node_no_net, "n.toml").is_ok());
        let two_nodes_no_net = one_node_no_net.replace("nodes = 1", "nodes = 2");
        let err = HostProfile::from_toml_str(&two_nodes_no_net, "n.toml").unwrap_err();
        assert_eq!(err.field(), Some("nodes"));
        assert_eq!(err.location().and_then(|l| l.line), Some(3));
        let zero_rate = OK.replace("matmul_gflops = 500", "matmul_gflops = 0");
        let err = HostProfile::from_toml_str(&zero_rate, "r.toml").unwrap_err();
        assert_eq!(err.field(), Some("devices[1].rates.matmul_gflops"));
    }
}

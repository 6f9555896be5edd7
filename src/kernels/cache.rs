//! Per-device pipeline cache: each (family, entry point, weight type, variant) is compiled
//! once, and the tuned variant choices of this device.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::quant::{QuantClass, QuantVariant};
use super::variants::{Class, Variant};
use super::{BindingKind, Family, WeightType};

/// A compiled compute pipeline and the explicit layout its bind groups use.
#[derive(Debug)]
pub struct Kernel {
    /// The pipeline.
    pub pipeline: wgpu::ComputePipeline,
    /// Bind group layout (group 0).
    pub layout: wgpu::BindGroupLayout,
}

/// (family, entry point, weight type, variant tag: "" for the plain pipeline).
type Key = (Family, &'static str, WeightType, &'static str);

/// `WGPAR_CHECKED_SHADERS=1` compiles every shader with wgpu's injected bounds checks and loop
/// bounding (the default path leaves them out; CI runs the kernel tests both ways).
fn checked_shaders() -> bool {
    crate::switches::flag(crate::switches::CHECKED_SHADERS)
}

/// Pipelines compiled on one device. Thread-safe; compilation happens at most once per key.
#[derive(Debug, Default)]
pub struct KernelCache {
    kernels: Mutex<HashMap<Key, Arc<Kernel>>>,
    // Keyed by the entries: families (and so every variant of an op) whose layouts have the
    // same entries share one layout object, so one bind group serves them all.
    layouts: Mutex<HashMap<&'static [BindingKind], wgpu::BindGroupLayout>>,
    modules: Mutex<HashMap<(Family, WeightType), wgpu::ShaderModule>>,
    choices: Mutex<HashMap<Class, &'static Variant>>,
    quant_choices: Mutex<HashMap<QuantClass, &'static QuantVariant>>,
}

impl KernelCache {
    /// The pipeline for `entry` of `family` with `weights`, compiling it on first use.
    pub fn get(
        &self,
        device: &wgpu::Device,
        family: Family,
        entry: &'static str,
        weights: WeightType,
    ) -> Arc<Kernel> {
        self.get_variant(device, family, entry, weights, &[], "")
    }

    /// The pipeline for `entry` of `family` with `weights` and the override `constants` of the
    /// variant `tag`, compiling it on first use.
    pub fn get_variant(
        &self,
        device: &wgpu::Device,
        family: Family,
        entry: &'static str,
        weights: WeightType,
        constants: &'static [(&'static str, f64)],
        tag: &'static str,
    ) -> Arc<Kernel> {
        let weights = if family.has_weight_variants() {
            weights
        } else {
            WeightType::F32
        };
        let key = (family, entry, weights, tag);
        if let Some(k) = self.kernels.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return k;
        }
        let layout = self.layout(device, family);
        let module = self.module(device, family, weights);
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(entry),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(entry),
            layout: Some(&pipeline_layout),
            module: &module,
            entry_point: Some(entry),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants,
                // Every kernel writes its workgroup memory before reading it.
                zero_initialize_workgroup_memory: checked_shaders(),
            },
            cache: None,
        });
        let kernel = Arc::new(Kernel { pipeline, layout });
        if let Ok(mut m) = self.kernels.lock() {
            // Another thread may have compiled it meanwhile: keep the first, so every caller
            // shares one pipeline.
            return m.entry(key).or_insert(kernel).clone();
        }
        kernel
    }

    /// The variant chosen on this device for `class`, if one has been.
    pub(crate) fn choice(&self, class: &Class) -> Option<&'static Variant> {
        self.choices.lock().ok().and_then(|m| m.get(class).copied())
    }

    /// Records the variant chosen on this device for `class`.
    /// The quantized matmul variant this device chose for `class`, if it has.
    pub(crate) fn quant_choice(&self, class: &QuantClass) -> Option<&'static QuantVariant> {
        (self.quant_choices.lock().ok()).and_then(|m| m.get(class).copied())
    }

    /// Keeps this device's quantized matmul choice for `class`.
    pub(crate) fn set_quant_choice(&self, class: QuantClass, variant: &'static QuantVariant) {
        if let Ok(mut m) = self.quant_choices.lock() {
            m.insert(class, variant);
        }
    }

    pub(crate) fn set_choice(&self, class: Class, variant: &'static Variant) {
        if let Ok(mut m) = self.choices.lock() {
            m.insert(class, variant);
        }
    }

    /// The shape classes this device has chosen a variant for (their keys, sorted), with the
    /// variant: what ran, for diagnostics and tests.
    pub fn choices(&self) -> Vec<(String, &'static str)> {
        let mut out: Vec<(String, &'static str)> = self
            .choices
            .lock()
            .map(|m| m.iter().map(|(c, v)| (c.key(), v.name)).collect())
            .unwrap_or_default();
        out.sort();
        out
    }

    /// Number of pipelines compiled so far.
    pub fn compiled(&self) -> usize {
        self.kernels.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// The bind group layout of `family`, made on first use and shared by every family with
    /// the same bindings.
    pub(crate) fn layout(&self, device: &wgpu::Device, family: Family) -> wgpu::BindGroupLayout {
        let mut layouts = match self.layouts.lock() {
            Ok(l) => l,
            Err(poisoned) => poisoned.into_inner(),
        };
        layouts
            .entry(family.bindings())
            .or_insert_with(|| {
                let entries: Vec<wgpu::BindGroupLayoutEntry> = family
                    .bindings()
                    .iter()
                    .enumerate()
                    .map(|(i, kind)| wgpu::BindGroupLayoutEntry {
                        binding: i as u32,
                        visibility: wgpu::ShaderStages::COMPUTE,
                        ty: match kind {
                            BindingKind::Uniform => wgpu::BindingType::Buffer {
                                ty: wgpu::BufferBindingType::Uniform,
                                has_dynamic_offset: false,
                                min_binding_size: None,
                            },
                            BindingKind::Read | BindingKind::ReadWrite => {
                                wgpu::BindingType::Buffer {
                                    ty: wgpu::BufferBindingType::Storage {
                                        read_only: *kind == BindingKind::Read,
                                    },
                                    has_dynamic_offset: false,
                                    min_binding_size: None,
                                }
                            }
                        },
                        count: None,
                    })
                    .collect();
                device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                    label: Some(&format!("{family:?}")),
                    entries: &entries,
                })
            })
            .clone()
    }

    fn module(
        &self,
        device: &wgpu::Device,
        family: Family,
        weights: WeightType,
    ) -> wgpu::ShaderModule {
        let mut modules = match self.modules.lock() {
            Ok(m) => m,
            Err(poisoned) => poisoned.into_inner(),
        };
        modules
            .entry((family, weights))
            .or_insert_with(|| {
                let desc = wgpu::ShaderModuleDescriptor {
                    label: Some(&format!("{family:?}/{weights:?}")),
                    source: wgpu::ShaderSource::Wgsl(family.source_for(weights).into()),
                };
                if checked_shaders() {
                    device.create_shader_module(desc)
                } else {
                    let mut checks = wgpu::ShaderRuntimeChecks::checked();
                    // Injected bounds checks and loop counters cost more than half the matmul
                    // throughput on lavapipe (measured in docs/BENCHMARKS.md).
                    checks.bounds_checks = false;
                    checks.force_loop_bounding = false;
                    // SAFETY: every kernel indexes only within the lengths its `ops` wrapper
                    // checked against the buffers on the host (a shorter buffer is an error
                    // before any dispatch), clamps edge rows and columns itself, and every loop
                    // is bounded by uniform shape parameters. Integer division checks stay on.
                    unsafe { device.create_shader_module_trusted(desc, checks) }
                }
            })
            .clone()
    }
}

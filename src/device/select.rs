//! Which devices a command uses and how they hold a model, as plain values (`--devices`,
//! `--virtual`, `--force-f32`, `--max-binding`, `--kv-dtype`): the adapters they select,
//! described without opening any for the checks that come first, then opened. The CLI fills
//! these from its options; examples and tests build them directly.

use std::sync::Arc;

use super::{
    open_devices, AdapterDesc, Adapters, DType, DeviceSelection, Gpu, GpuOptions, KvCacheType,
};
use crate::error::Result;

/// How the devices hold a model: a storage-binding cap below the adapters' own, and the
/// KV cache's element type.
#[derive(Debug, Clone, Copy, Default)]
pub struct BindingChoice {
    /// Bind at most this many bytes per storage buffer (`--max-binding`).
    pub max_binding: Option<u64>,
    /// The KV cache's element type (`--kv-dtype`).
    pub kv_cache: KvCacheType,
}

impl BindingChoice {
    /// Device options with this cap and KV type (f32 forcing comes from the environment alone).
    pub fn gpu_options(&self) -> GpuOptions {
        GpuOptions {
            force_f32: false,
            max_storage_binding: self.max_binding,
            kv_cache: self.kv_cache,
        }
    }

    /// The KV-cache type each of `selected` will store (`force_f32`: `--force-f32`), as
    /// opening them will resolve it; f32 where f16 would be refused (opening refuses it).
    pub fn kv_dtypes(&self, selected: &[AdapterDesc], force_f32: bool) -> Vec<DType> {
        let force = force_f32 || crate::switches::flag(crate::switches::FORCE_F32);
        (selected.iter())
            .map(|a| (self.kv_cache.resolve(a.shader_f16 && !force)).unwrap_or(DType::F32))
            .collect()
    }

    /// Refuses an f16 KV cache before any device opens when a selected adapter lacks
    /// SHADER_F16 (opening would refuse it too, later).
    pub fn check_kv(&self, selected: &[AdapterDesc]) -> Result<()> {
        for a in selected {
            self.kv_cache.resolve_on(a, a.shader_f16, false)?;
        }
        Ok(())
    }

    /// `selected` as the checks before opening must see them: with the cap the devices will
    /// be opened with.
    pub fn apply(&self, mut selected: Vec<AdapterDesc>) -> Vec<AdapterDesc> {
        if let Some(cap) = self.max_binding {
            for adapter in &mut selected {
                adapter.max_storage_binding = adapter.max_storage_binding.min(cap);
            }
        }
        selected
    }

    /// The adapters of `selection`, described without opening any, with the cap applied and
    /// the KV type checked.
    pub fn described(
        &self,
        selection: &DeviceSelection,
        adapters: &Adapters,
    ) -> Result<Vec<AdapterDesc>> {
        let selected = self.apply(described(selection, adapters)?);
        self.check_kv(&selected)?;
        Ok(selected)
    }
}

/// The devices a command selects and how they hold a model.
#[derive(Debug, Clone, Default)]
pub struct DeviceChoice {
    /// Adapter indices, comma-separated (`--devices`); `None`: the preferred adapter.
    pub devices: Option<String>,
    /// N independent devices on one adapter (`--virtual N`).
    pub virtual_count: Option<usize>,
    /// Keep weights in f32 even where the adapter has SHADER_F16 (`--force-f32`).
    pub force_f32: bool,
    /// The binding cap and KV type.
    pub binding: BindingChoice,
}

impl DeviceChoice {
    /// Devices the choice selects (before any opens).
    pub fn count(&self) -> usize {
        match (&self.virtual_count, &self.devices) {
            (Some(n), _) => *n,
            (None, Some(list)) => list.split(',').count(),
            (None, None) => 1,
        }
    }

    /// The selection among `adapters`.
    pub fn selection(&self, adapters: &Adapters) -> Result<DeviceSelection> {
        DeviceSelection::from_options(self.devices.as_deref(), self.virtual_count, adapters)
    }

    /// Opens every selected device.
    pub fn open(&self, adapters: &Adapters) -> Result<Vec<Arc<Gpu>>> {
        open_devices(adapters, &self.selection(adapters)?, &self.gpu_options())
    }

    /// The options every device opens with.
    pub fn gpu_options(&self) -> GpuOptions {
        GpuOptions {
            force_f32: self.force_f32,
            ..self.binding.gpu_options()
        }
    }

    /// The KV-cache type each of `selected` will store once opened.
    pub fn kv_dtypes(&self, selected: &[AdapterDesc]) -> Vec<DType> {
        self.binding.kv_dtypes(selected, self.force_f32)
    }

    /// The adapter of each selected device, in order, without opening any: what the checks
    /// that must come before opening devices need.
    pub fn selected(&self, adapters: &Adapters) -> Result<Vec<AdapterDesc>> {
        self.binding.described(&self.selection(adapters)?, adapters)
    }

    /// Opens only the first `count` selected devices.
    pub fn open_first(&self, adapters: &Adapters, count: usize) -> Result<Vec<Arc<Gpu>>> {
        let selection = match self.selection(adapters)? {
            DeviceSelection::Indices(mut v) => {
                v.truncate(count);
                DeviceSelection::Indices(v)
            }
            DeviceSelection::Virtual { adapter, count: n } => DeviceSelection::Virtual {
                adapter,
                count: n.min(count),
            },
        };
        open_devices(adapters, &selection, &self.gpu_options())
    }

    /// This choice, or one device when it names none (what one MPI rank opens by default).
    pub fn one_unless_named(&self) -> Self {
        let mut choice = self.clone();
        if choice.devices.is_none() && choice.virtual_count.is_none() {
            choice.virtual_count = Some(1);
        }
        choice
    }
}

/// The adapter of each device of `selection`, in order, without opening any.
pub fn described(selection: &DeviceSelection, adapters: &Adapters) -> Result<Vec<AdapterDesc>> {
    let indices = match selection {
        DeviceSelection::Indices(v) => v.clone(),
        DeviceSelection::Virtual { adapter, count } => vec![*adapter; *count],
    };
    indices
        .into_iter()
        .map(|i| adapters.get(i).map(|(_, d)| d.clone()))
        .collect()
}

/// Parses `--virtual N`: 1 to [`super::MAX_DEVICES`].
pub fn parse_virtual(text: &str) -> std::result::Result<usize, String> {
    let max = super::MAX_DEVICES;
    match text.trim().parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        Ok(n) => Err(format!("{n} devices: select 1 to {max}")),
        Err(e) => Err(format!("'{text}' is not a device count: {e}")),
    }
}

/// Parses `--max-binding SIZE`: a size of at least 256 bytes.
pub fn parse_binding(text: &str) -> std::result::Result<u64, String> {
    let bytes = crate::comm::units::parse_size(text).map_err(|e| e.to_string())?;
    if bytes < 256 {
        return Err(format!(
            "{bytes} B is below the smallest binding wgpar opens (256 B)"
        ));
    }
    Ok(bytes)
}

//! Devices: adapter discovery on every backend, `Gpu` (device + queue + limits + error capture),
//! tensors, and device sets (real adapters or several virtual devices on one adapter).

mod adapter;
mod gpu;
mod select;
mod tensor;
mod timer;

use std::sync::Arc;

pub use adapter::{AdapterDesc, Adapters};
pub(crate) use gpu::CreationCounts;
pub use gpu::{Created, Gpu, GpuOptions, KvCacheType, Readback};
pub use select::{described, parse_binding, parse_virtual, BindingChoice, DeviceChoice};
pub use tensor::{DType, Tensor};
pub use timer::{GpuTimer, SpanTimer};

use crate::error::{Result, WgparError};

/// Most devices one process selects (`--virtual N`, or indices in `--devices`): far more than
/// any strategy splits a model over, small enough that describing them costs nothing.
pub const MAX_DEVICES: usize = 4096;

/// Which devices a run uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSelection {
    /// One device on each listed adapter index (`--devices 0,1`); an index may repeat.
    Indices(Vec<usize>),
    /// `count` independent devices on one adapter (`--virtual N`): how one machine stands in
    /// for N GPUs.
    Virtual {
        /// The adapter index.
        adapter: usize,
        /// How many devices.
        count: usize,
    },
}

impl DeviceSelection {
    /// Parses `--devices` ("0,1") and `--virtual` (N) options; `None` for both means one device
    /// on the preferred adapter.
    pub fn from_options(
        devices: Option<&str>,
        virtual_count: Option<usize>,
        adapters: &Adapters,
    ) -> Result<Self> {
        let too_many = |n: usize, option: &str| {
            WgparError::option(
                option,
                format!("{option} selects {n} devices; at most {MAX_DEVICES} can be selected"),
            )
        };
        if let Some(n) = virtual_count.filter(|&n| n > MAX_DEVICES) {
            return Err(too_many(n, "--virtual"));
        }
        if let Some(n) = devices
            .map(|text| text.split(',').count())
            .filter(|&n| n > MAX_DEVICES)
        {
            return Err(too_many(n, "--devices"));
        }
        let indices = match devices {
            Some(text) => text
                .split(',')
                .map(|s| {
                    s.trim().parse::<usize>().map_err(|_| {
                        WgparError::option(
                            "--devices",
                            format!(
                                "--devices expects comma-separated adapter indices, got '{text}'"
                            ),
                        )
                    })
                })
                .collect::<Result<Vec<_>>>()?,
            None => vec![adapters.preferred()],
        };
        match virtual_count {
            Some(0) => Err(WgparError::option(
                "--virtual",
                "--virtual needs at least 1 device".into(),
            )),
            Some(count) if indices.len() == 1 => Ok(Self::Virtual {
                adapter: indices[0],
                count,
            }),
            Some(_) => Err(WgparError::unsupported(
                "--virtual N takes a single adapter in --devices".into(),
            )),
            None => Ok(Self::Indices(indices)),
        }
    }

    /// Number of devices selected.
    pub fn count(&self) -> usize {
        match self {
            Self::Indices(v) => v.len(),
            Self::Virtual { count, .. } => *count,
        }
    }
}

/// Opens the selected devices, labelled gpu0, gpu1, ... in selection order.
pub fn open_devices(
    adapters: &Adapters,
    selection: &DeviceSelection,
    options: &GpuOptions,
) -> Result<Vec<Arc<Gpu>>> {
    let indices: Vec<usize> = match selection {
        DeviceSelection::Indices(v) => v.clone(),
        DeviceSelection::Virtual { adapter, count } => vec![*adapter; *count],
    };
    if indices.is_empty() {
        return Err(WgparError::option(
            "--devices",
            "no devices selected".into(),
        ));
    }
    indices
        .iter()
        .enumerate()
        .map(|(ordinal, &index)| {
            let (adapter, desc) = adapters.get(index)?;
            Gpu::open(adapter, desc, ordinal, options).map(Arc::new)
        })
        .collect()
}

//! The integer-dot candidates of the quantized matmul (`shaders/matmul_quant_dp4.wgsl`): a
//! decode GEMV that quantizes the input rows to int8 (one f32 scale per 32 values, in
//! workgroup memory, once per workgroup and step) and dots them with the weights' raw quants in
//! WGSL's packed 4x8 integer dot product (`dot4I8Packed`). Same binding layout as the packed
//! GEMV, so [`super::quant::QuantMatmul`] runs either. Two roundings, each with 64 and 128
//! invocations (the pipeline constant `DP_PARTS`):
//!
//! - **One part** (`qdp4gemv*`), as llama.cpp's q8_1 path: `x ~ d * qx`. It runs only when
//!   forced (`WGPAR_KERNELS`): its int8 inputs change SmolLM2-135M's greedy answer (see
//!   [`super::quant::tuned_candidates`]).
//! - **Two parts** (`qdp4x2gemv*`): `x ~ d * qx + (d / 254) * qr`, the residual rounded again
//!   to int8 on a grid 254 times finer, each weight word dotted with both (twice the integer
//!   dot products). An ordinary tuner candidate for the layers ([`two_part`]).
//!
//! Neither runs where [`offered`] says the adapter lacks a native integer dot, nor as the LM
//! head ([`super::quant::QuantRole::Logits`]).
//!
//! Every packed type has the variants: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K unpack
//! whole words with masks and shifts; Q2_K, Q3_K, IQ4_NL and IQ4_XS pack their quants byte by
//! byte from the shared block reader (their quants, and IQ4's levels, fit int8 too).
//!
//! Accuracy: the result is `sum_j w_j * x'_j` up to f32 rounding, with `x'_j` the rounded
//! input, so it differs from the exact product by at most `sum_j |w_j| * d / 2` with one part
//! (d = the largest |x| of x_j's 32-value group / 127) and `sum_j |w_j| * d / 508` with two,
//! the bounds `tests/kernels_quant_dp4.rs` checks per type.

use super::quant::QuantVariant;
use crate::device::Gpu;
use crate::error::{Result, WgparError};
use crate::model::quant::QuantType;

/// Weight rows per workgroup (`GV_COLS`): the inputs' quantization, which every workgroup
/// repeats, is amortized over them.
const DP4_COLS: f64 = 8.0;

/// A `qgemv_dp4` variant on `$t` blocks: `$parts` int8 parts per input, `$wg` invocations.
macro_rules! dp4 {
    ($name:expr, $t:ident, $id:literal, parts $parts:literal, wg $wg:literal) => {
        QuantVariant {
            name: $name,
            entry: "qgemv_dp4",
            qtype: QuantType::$t,
            subgroups: false,
            constants: &[
                ("QTYPE", $id as f64),
                ("GV_WG", $wg as f64),
                ("GV_COLS", DP4_COLS),
                ("DP_PARTS", $parts as f64),
            ],
        }
    };
}

macro_rules! dp4_variants {
    ($($t:ident $id:literal $suffix:literal),*) => {
        /// Every integer-dot GEMV variant: per type, one-part (`qdp4gemv`, llama.cpp's q8_1
        /// rounding) and two-part (`qdp4x2gemv`, the residual too), each with 64 and 128
        /// invocations.
        pub static DP4_VARIANTS: &[QuantVariant] = &[$(
            dp4!(concat!("qdp4gemv64_", $suffix), $t, $id, parts 1, wg 64),
            dp4!(concat!("qdp4gemv128_", $suffix), $t, $id, parts 1, wg 128),
            dp4!(concat!("qdp4x2gemv64_", $suffix), $t, $id, parts 2, wg 64),
            dp4!(concat!("qdp4x2gemv128_", $suffix), $t, $id, parts 2, wg 128),
        )*];
    };
}

dp4_variants!(
    Q8_0 8 "q8_0", Q4_0 2 "q4_0", Q4_1 3 "q4_1", Q5_0 6 "q5_0", Q5_1 7 "q5_1",
    Q2K 10 "q2_k", Q3K 11 "q3_k", Q4K 12 "q4_k", Q5K 13 "q5_k", Q6K 14 "q6_k",
    Iq4Nl 20 "iq4_nl", Iq4Xs 23 "iq4_xs"
);

/// The integer-dot variant named `name`.
pub fn by_name(name: &str) -> Option<&'static QuantVariant> {
    DP4_VARIANTS.iter().find(|v| v.name == name)
}

/// Whether `v` is a two-part integer-dot variant (`qdp4x2gemv*`): accurate enough for the
/// tuner to time ([`super::quant::tuned_candidates`]), where the one-part ones run only when
/// forced.
pub fn two_part(v: &QuantVariant) -> bool {
    (v.constants.iter()).any(|&(k, c)| k == "DP_PARTS" && c == 2.0)
}

/// The integer-dot candidates for `qtype` on `gpu`: its variants (both roundings) where
/// [`offered`], none otherwise.
pub fn candidates(gpu: &Gpu, qtype: QuantType) -> Vec<&'static QuantVariant> {
    if offered(gpu).is_err() {
        return Vec::new();
    }
    DP4_VARIANTS.iter().filter(|v| v.qtype == qtype).collect()
}

/// Refuses a forced integer-dot variant (`WGPAR_KERNELS`) on an adapter that does not offer
/// it, naming why, rather than running something else silently.
pub fn refuse_forced(gpu: &Gpu, forced: &[String]) -> Result<()> {
    let Some(name) = forced.iter().find(|n| by_name(n).is_some()) else {
        return Ok(());
    };
    offered(gpu).map_err(|why| {
        WgparError::unsupported(format!(
            "WGPAR_KERNELS names {name}, an integer-dot kernel, which adapter {} does not \
             offer: {why}",
            gpu.info().label()
        ))
    })
}

/// Whether `gpu` runs `dot4I8Packed` as a native instruction: `Ok`, or why not. wgpu always
/// accepts the builtin (naga implements the WGSL language extension
/// `packed_4x8_integer_dot_product`, which `wgpu::Instance::wgsl_language_features` reports),
/// but where the driver lacks integer dot products naga emulates it with shifts and four
/// multiplies, which cannot beat the f32 GEMV; there the variants are not candidates. Native:
/// Vulkan with `VK_KHR_shader_integer_dot_product` (core in Vulkan 1.3) and Metal. Lavapipe
/// (Vulkan 1.3 on Mesa 22.3 and 25.0 alike) passes, so its tuner times the two-part variants,
/// and they lose to the block-wise f32 GEMVs there (docs/BENCHMARKS.md); llvmpipe's GL fails.
pub fn offered(gpu: &Gpu) -> std::result::Result<(), String> {
    use naga::front::wgsl::ImplementedLanguageExtension as Ext;
    if !Ext::all().contains(&Ext::Packed4x8IntegerDotProduct) {
        return Err("this build's WGSL front end lacks packed_4x8_integer_dot_product".into());
    }
    let backend = gpu.info().backend.as_str();
    match backend {
        "Metal" => Ok(()),
        "Vulkan" => vulkan_int_dot(gpu),
        _ => Err(format!(
            "on {backend}, naga emulates dot4I8Packed (no native integer dot product known)"
        )),
    }
}

/// Whether the Vulkan device has integer dot products: the extension enabled, or API 1.3.
#[cfg(any(
    windows,
    target_os = "linux",
    target_os = "android",
    target_os = "freebsd"
))]
fn vulkan_int_dot(gpu: &Gpu) -> std::result::Result<(), String> {
    const EXT: &[u8] = b"VK_KHR_shader_integer_dot_product";
    // SAFETY: the raw handles are only read (extension list, physical device properties)
    // while the device is alive; nothing is created or destroyed through them.
    let hal = unsafe { gpu.device().as_hal::<wgpu::hal::api::Vulkan>() };
    let Some(dev) = hal else {
        return Err("the Vulkan device exposes no driver handle".into());
    };
    let ext = dev
        .enabled_device_extensions()
        .iter()
        .any(|e| e.to_bytes() == EXT);
    // SAFETY: a query on the device's own physical device and instance.
    let props = unsafe {
        dev.shared_instance()
            .raw_instance()
            .get_physical_device_properties(dev.raw_physical_device())
    };
    let (major, minor) = (
        props.api_version >> 22 & 0x7f,
        props.api_version >> 12 & 0x3ff,
    );
    if ext || (major, minor) >= (1, 3) {
        Ok(())
    } else {
        Err(format!(
            "Vulkan {major}.{minor} device without VK_KHR_shader_integer_dot_product: naga \
             would emulate dot4I8Packed"
        ))
    }
}

#[cfg(not(any(
    windows,
    target_os = "linux",
    target_os = "android",
    target_os = "freebsd"
)))]
fn vulkan_int_dot(_gpu: &Gpu) -> std::result::Result<(), String> {
    Err("this build has no Vulkan driver access".into())
}

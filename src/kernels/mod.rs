//! WGSL kernels: sources (`shaders/*.wgsl`, one file per op family), explicit bind group
//! layouts, a per-device pipeline cache, and typed op functions that check shapes and encode
//! dispatches.

pub mod bench;
pub mod bench_options;
pub mod bench_table;
mod cache;
pub mod ops;
pub mod quant;
pub mod quant_dp4;
pub mod roofline;
pub mod tune;
pub mod variants;

pub use cache::{Kernel, KernelCache};

/// Storage type of the weights a kernel reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum WeightType {
    /// f32 weights.
    F32,
    /// f16 weights (needs `SHADER_F16`).
    F16,
}

/// How one binding of a family's layout is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BindingKind {
    /// `var<storage, read>`.
    Read,
    /// `var<storage, read_write>`.
    ReadWrite,
    /// `var<uniform>` parameters.
    Uniform,
}

/// An op family: one `.wgsl` file whose entry points share one bind group layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// `matmul.wgsl`: tiled and naive matrix multiply.
    Matmul,
    /// `matmul_vec4.wgsl`: matmul variants with vec4 loads, for inner dimensions divisible by 4
    /// (register-tiled, decode GEMV, workgroup-memory tiled GEMM).
    MatmulVec4,
    /// `matmul_subgroup.wgsl`: decode GEMV with subgroup reductions (needs `SUBGROUP`).
    MatmulSubgroup,
    /// `matmul_block.wgsl`: block GEMM with large per-invocation register tiles staged through
    /// workgroup memory (prefill shapes, inner dimension divisible by 4).
    MatmulBlock,
    /// `matmul_quant.wgsl`: decode GEMV and prefill GEMM on block-quantized weights (Q8_0,
    /// Q4_0, Q4_K, Q6_K), dequantized in registers.
    MatmulQuant,
    /// `matmul_quant_dp4.wgsl`: decode GEMV on the same packed weights with int8 inputs and
    /// packed 4x8 integer dot products (`dot4I8Packed`).
    MatmulQuantDp4,
    /// `matmul_quant_gemv.wgsl`: block-wise decode GEMV on packed weights (whole-word loads,
    /// scales unpacked once per block, x read as vec4), reduced in workgroup memory.
    MatmulQuantGemv,
    /// `matmul_quant_subgroup.wgsl`: the same GEMV reduced with subgroups (needs `SUBGROUP`).
    MatmulQuantSubgroup,
    /// `norm.wgsl`: LayerNorm, RMSNorm, and RMSNorm of each head in place.
    Norm,
    /// `softmax.wgsl`: row softmax.
    Softmax,
    /// `attention.wgsl`: causal or bidirectional attention over a KV cache.
    Attention,
    /// `kvcache.wgsl`: KV cache append.
    KvCache,
    /// `rope.wgsl`: rotary embedding.
    Rope,
    /// `elementwise.wgsl`: residual add, bias, GELU, SwiGLU.
    Elementwise,
    /// `embedding.wgsl`: token (+ position, + token type) embedding lookup.
    Embedding,
    /// `embedding_quant.wgsl`: the same lookup from a token table held in ggml blocks.
    EmbeddingQuant,
    /// `pool.wgsl`: encoder pooling (mean or first token, optional L2 normalisation).
    Pool,
    /// `argmax.wgsl`: the next token per row of logits (greedy, or top-k/top-p sampling),
    /// with a count of non-finite logits.
    Argmax,
    /// `copy.wgsl`: a vec4 buffer copy, the kernel benchmark's bandwidth probe.
    Copy,
}

impl Family {
    /// Every family, for validation tests.
    pub const ALL: [Family; 19] = [
        Family::Matmul,
        Family::MatmulVec4,
        Family::MatmulSubgroup,
        Family::MatmulBlock,
        Family::MatmulQuant,
        Family::MatmulQuantDp4,
        Family::MatmulQuantGemv,
        Family::MatmulQuantSubgroup,
        Family::Norm,
        Family::Softmax,
        Family::Attention,
        Family::KvCache,
        Family::Rope,
        Family::Elementwise,
        Family::Embedding,
        Family::EmbeddingQuant,
        Family::Pool,
        Family::Argmax,
        Family::Copy,
    ];

    /// The WGSL source as shipped. The families on packed blocks have the block readers
    /// (`quant_blocks.wgsl`) appended (the block-wise GEMVs also their shared part,
    /// `quant_gemv_common.wgsl`), the two embedding lookups their shared part
    /// (`embedding_common.wgsl`).
    pub fn source(self) -> &'static str {
        match self {
            Family::Matmul => include_str!("../../shaders/matmul.wgsl"),
            Family::MatmulVec4 => include_str!("../../shaders/matmul_vec4.wgsl"),
            Family::MatmulSubgroup => include_str!("../../shaders/matmul_subgroup.wgsl"),
            Family::MatmulBlock => include_str!("../../shaders/matmul_block.wgsl"),
            Family::MatmulQuant => concat!(
                include_str!("../../shaders/matmul_quant.wgsl"),
                include_str!("../../shaders/quant_blocks.wgsl")
            ),
            Family::MatmulQuantDp4 => concat!(
                include_str!("../../shaders/matmul_quant_dp4.wgsl"),
                include_str!("../../shaders/quant_blocks.wgsl")
            ),
            Family::MatmulQuantGemv => concat!(
                include_str!("../../shaders/matmul_quant_gemv.wgsl"),
                include_str!("../../shaders/quant_gemv_common.wgsl"),
                include_str!("../../shaders/quant_blocks.wgsl")
            ),
            Family::MatmulQuantSubgroup => concat!(
                include_str!("../../shaders/matmul_quant_subgroup.wgsl"),
                include_str!("../../shaders/quant_gemv_common.wgsl"),
                include_str!("../../shaders/quant_blocks.wgsl")
            ),
            Family::Norm => include_str!("../../shaders/norm.wgsl"),
            Family::Softmax => include_str!("../../shaders/softmax.wgsl"),
            Family::Attention => concat!(
                include_str!("../../shaders/attention.wgsl"),
                include_str!("../../shaders/kv_blocks.wgsl")
            ),
            Family::KvCache => concat!(
                include_str!("../../shaders/kvcache.wgsl"),
                include_str!("../../shaders/kv_blocks.wgsl")
            ),
            Family::Rope => include_str!("../../shaders/rope.wgsl"),
            Family::Elementwise => include_str!("../../shaders/elementwise.wgsl"),
            Family::Embedding => concat!(
                include_str!("../../shaders/embedding.wgsl"),
                include_str!("../../shaders/embedding_common.wgsl")
            ),
            Family::EmbeddingQuant => concat!(
                include_str!("../../shaders/embedding_quant.wgsl"),
                include_str!("../../shaders/embedding_common.wgsl"),
                include_str!("../../shaders/quant_blocks.wgsl")
            ),
            Family::Pool => include_str!("../../shaders/pool.wgsl"),
            Family::Argmax => include_str!("../../shaders/argmax.wgsl"),
            Family::Copy => include_str!("../../shaders/copy.wgsl"),
        }
    }

    /// Whether the family has an f16 variant: it reads weights through the `WT` alias, or
    /// (attention, KV append) stores the KV cache through the `KT` alias.
    pub fn has_weight_variants(self) -> bool {
        self.stored_alias().is_some()
    }

    /// The alias the f16 variant retypes.
    fn stored_alias(self) -> Option<&'static str> {
        match self {
            Family::Matmul
            | Family::MatmulVec4
            | Family::MatmulSubgroup
            | Family::MatmulBlock
            | Family::Embedding => Some("WT"),
            Family::Attention | Family::KvCache => Some("KT"),
            _ => None,
        }
    }

    /// The source specialised for a stored type (weights, or the KV cache): the f16 variant
    /// enables the extension and retypes the `WT`/`KT` alias. Other families ignore the type.
    pub fn source_for(self, weights: WeightType) -> String {
        let src = self.source();
        match self.stored_alias() {
            Some(alias) if weights == WeightType::F16 => format!(
                "enable f16;\n{}",
                src.replacen(
                    &format!("alias {alias} = f32;"),
                    &format!("alias {alias} = f16;"),
                    1
                )
            ),
            _ => src.to_string(),
        }
    }

    /// The bind group layout shared by the family's entry points, in binding order.
    pub fn bindings(self) -> &'static [BindingKind] {
        use BindingKind::*;
        match self {
            Family::Matmul
            | Family::MatmulVec4
            | Family::MatmulSubgroup
            | Family::MatmulBlock
            | Family::MatmulQuant
            | Family::MatmulQuantDp4
            | Family::MatmulQuantGemv
            | Family::MatmulQuantSubgroup => &[Read, Read, Read, ReadWrite, Uniform],
            Family::Norm => &[Read, ReadWrite, Read, Read, Uniform],
            Family::Softmax => &[ReadWrite, Uniform],
            // Position-dependent families read the step's sequence table just before the
            // params (see `ops::KvCache`); the KV families then the cache's block table.
            Family::Attention => &[Read, Read, Read, Read, ReadWrite, Read, Read, Uniform],
            Family::KvCache => &[Read, Read, ReadWrite, ReadWrite, Read, Read, Uniform],
            Family::Rope => &[ReadWrite, Read, Read, Read, Uniform],
            Family::Elementwise => &[ReadWrite, Read, Uniform],
            Family::Embedding | Family::EmbeddingQuant => {
                &[Read, Read, Read, ReadWrite, Read, Read, Read, Uniform]
            }
            Family::Pool => &[Read, Read, ReadWrite, Uniform],
            Family::Argmax => &[Read, Read, ReadWrite, Read, Read, Uniform],
            Family::Copy => &[Read, ReadWrite, Uniform],
        }
    }

    /// Entry points of the family.
    pub fn entry_points(self) -> &'static [&'static str] {
        match self {
            Family::Matmul => &["matmul", "matmul_naive", "gemm_tiled_scalar"],
            Family::MatmulVec4 => &["matmul_vec4", "matmul_vec4_rt", "gemv", "gemm_tiled"],
            Family::MatmulSubgroup => &["gemv_subgroup"],
            Family::MatmulBlock => &["gemm_block"],
            Family::MatmulQuant => &["qgemv", "qgemm", "qgemm_tile"],
            Family::MatmulQuantDp4 => &["qgemv_dp4"],
            Family::MatmulQuantGemv => &["qgemv_wg"],
            Family::MatmulQuantSubgroup => &["qgemv_sg"],
            Family::Norm => &["layernorm", "rmsnorm", "rmsnorm_heads"],
            Family::Softmax => &["softmax"],
            Family::Attention => &["attend", "attend_tiled", "attend_split"],
            Family::KvCache => &["kv_store"],
            Family::Rope => &["rope"],
            Family::Elementwise => &[
                "add", "bias_add", "gelu", "gelu_erf", "swiglu", "geglu", "scale", "softcap",
            ],
            Family::Embedding => &["embed"],
            Family::EmbeddingQuant => &["qembed"],
            Family::Pool => &["pool"],
            Family::Argmax => &["argmax", "sample"],
            Family::Copy => &["copy_vec4"],
        }
    }
}

/// Applies a variant's override constants to a parsed module for its entry point, as wgpu does
/// when it creates the pipeline, and validates the result (naga, no GPU): the module the device
/// would compile. Panics naming the variant.
#[cfg(test)]
pub(crate) fn with_overrides(
    module: &naga::Module,
    name: &str,
    entry: &str,
    constants: &[(&str, f64)],
) -> naga::Module {
    let mut validator = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    );
    let info = validator
        .validate(module)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let constants: naga::back::PipelineConstants =
        constants.iter().map(|(k, c)| (k.to_string(), *c)).collect();
    let (module, _) = naga::back::pipeline_constants::process_overrides(
        module,
        &info,
        Some((naga::ShaderStage::Compute, entry)),
        &constants,
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    validator
        .validate(&module)
        .unwrap_or_else(|e| panic!("{name} after overrides: {e}"));
    module.into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn validate(name: &str, src: &str) -> naga::Module {
        let module = naga::front::wgsl::parse_str(src)
            .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(src)));
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(src)));
        module
    }

    /// Every shader, in every weight variant, parses and validates with naga: no GPU needed.
    #[test]
    fn every_shader_validates_with_naga() {
        for family in Family::ALL {
            for weights in [WeightType::F32, WeightType::F16] {
                let src = family.source_for(weights);
                let module = validate(&format!("{family:?}/{weights:?}"), &src);
                for entry in family.entry_points() {
                    assert!(
                        module.entry_points.iter().any(|e| e.name == *entry),
                        "{family:?} lacks entry point {entry}"
                    );
                }
                // The declared layout must match the shader's globals, binding by binding.
                let mut globals: Vec<(u32, BindingKind)> = module
                    .global_variables
                    .iter()
                    .filter_map(|(_, g)| {
                        let binding = g.binding.as_ref()?;
                        let kind = match g.space {
                            naga::AddressSpace::Uniform => BindingKind::Uniform,
                            naga::AddressSpace::Storage { access }
                                if access.contains(naga::StorageAccess::STORE) =>
                            {
                                BindingKind::ReadWrite
                            }
                            naga::AddressSpace::Storage { .. } => BindingKind::Read,
                            _ => return None,
                        };
                        Some((binding.binding, kind))
                    })
                    .collect();
                globals.sort_by_key(|g| g.0);
                let expected: Vec<(u32, BindingKind)> = family
                    .bindings()
                    .iter()
                    .enumerate()
                    .map(|(i, k)| (i as u32, *k))
                    .collect();
                assert_eq!(
                    globals, expected,
                    "{family:?} layout differs from its shader"
                );
            }
        }
    }

    /// Every kernel variant's override constants exist in its module and give a valid module
    /// for its entry point (what wgpu does when it creates the pipeline).
    #[test]
    fn every_variant_validates_with_its_constants() {
        for v in variants::MATMUL.iter().chain(variants::ATTENTION) {
            for weights in [WeightType::F32, WeightType::F16] {
                let src = v.family.source_for(weights);
                let module = validate(v.name, &src);
                let module = with_overrides(&module, v.name, v.entry, v.constants);
                let ep = module
                    .entry_points
                    .iter()
                    .find(|e| e.name == v.entry)
                    .unwrap_or_else(|| panic!("{}: no entry {}", v.name, v.entry));
                let threads: u32 = ep.workgroup_size.iter().product();
                assert!(
                    (1..=256).contains(&threads),
                    "{}: {threads} invocations",
                    v.name
                );
            }
        }
    }

    #[test]
    fn f16_variant_enables_the_extension() {
        let src = Family::Matmul.source_for(WeightType::F16);
        assert!(src.starts_with("enable f16;"));
        assert!(src.contains("alias WT = f16;"));
        assert_eq!(
            Family::Norm.source_for(WeightType::F16),
            Family::Norm.source()
        );
        for family in [Family::Attention, Family::KvCache] {
            let src = family.source_for(WeightType::F16);
            assert!(src.starts_with("enable f16;"), "{family:?}");
            assert!(src.contains("alias KT = f16;"), "{family:?}");
        }
    }
}

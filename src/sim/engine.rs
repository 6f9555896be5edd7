//! Engines: how a software stack runs on a machine (`hosts/engines/*.toml`).
//!
//! A host profile says what the hardware can do (peak FLOP rates, memory bandwidth, links); an
//! engine says what a software stack makes of it: the arithmetic it computes in and the
//! fraction of the peak it reaches per class of operation, the activation format it sends, and
//! which collective it runs over which link, at what fraction of the link. Projecting one run
//! onto one profile with two engines (`wgpar` and `cuda-nccl`) is the explicit comparison of
//! wgpar against CUDA + NCCL on that machine. The format is documented, with an example, in
//! `docs/PROJECTION.md`.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::locate::FieldPath;
use super::numformat::NumFormat;
use super::profile::HostProfile;
use super::profile_error::ProfileError;
use super::rules::{self, Violation};

/// A software stack as the projection sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Engine {
    /// Short name, e.g. `cuda-nccl`; shipped engines match their file name.
    pub name: String,
    /// How reports label it, e.g. `CUDA+NCCL` (defaults to the name).
    #[serde(default)]
    pub label: String,
    /// One line about it.
    #[serde(default)]
    pub description: String,
    /// Arithmetic and efficiency of its kernels.
    pub compute: EngineCompute,
    /// What it sends between devices.
    pub wire: Wire,
    /// Collectives it can run, in order of preference; the first one the machine allows is
    /// used (see [`LinkKind::available`]).
    pub collectives: Vec<CollectiveEntry>,
}

/// The kernels of an engine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineCompute {
    /// Arithmetic precision of its matmuls: `f32`, `f16`, `bf16` or `fp8`. With `f32` a span's
    /// recorded precision is kept.
    pub dtype: NumFormat,
    /// Matmuls run on the matrix units (tensor cores) where the device has them
    /// (`f16_tensor_tflops`); otherwise on the shader cores.
    #[serde(default)]
    pub tensor_cores: bool,
    /// These are the kernels `wgpar calibrate` measures: on a calibrated profile the measured
    /// rates, links and collective cost are used as they are, and the fractions below only
    /// apply to spec-sheet profiles.
    #[serde(default)]
    pub calibrated: bool,
    /// Fraction of the peak FLOP rate large matmuls reach (prefill GEMMs).
    pub gemm: f64,
    /// Fraction of the peak FLOP rate attention reaches.
    pub attention: f64,
    /// Fraction of the peak memory bandwidth memory-bound kernels reach (decode GEMV, norms,
    /// KV-cache reads).
    pub memory: f64,
    /// Fixed cost of one kernel launch on the device's timeline, microseconds; absent: the
    /// profile's `launch_overhead_us`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch_overhead_us: Option<f64>,
    /// Query tokens per pass over the KV cache in prefill attention: 1 when every token
    /// streams its whole context (wgpar's kernel), a tile size for flash attention.
    #[serde(default = "one")]
    pub attention_query_block: u32,
    /// Format of the KV cache.
    #[serde(default = "f32_format")]
    pub kv_dtype: NumFormat,
    /// Fraction of each device's memory the engine may fill (vLLM's
    /// `gpu_memory_utilization`); 1 when it may take all of it.
    #[serde(default = "unit")]
    pub memory_fraction: f64,
    /// Memory the engine holds besides weights, KV cache and activations (runtime context,
    /// workspaces), bytes per device.
    #[serde(default)]
    pub memory_reserve_bytes: u64,
    /// The KV cache is allocated for the model's whole context (`max_seq`) up front, as wgpar
    /// does; `false`: only for the tokens in use (paged caches).
    #[serde(default)]
    pub kv_preallocated: bool,
    /// Embedding and LM head are split over the tensor-parallel ranks (Megatron's
    /// vocab-parallel layers); `false`: every rank holds them whole.
    #[serde(default)]
    pub vocab_parallel: bool,
    /// Tokens are sampled on the device and only token ids come back to the host; `false`:
    /// the logits are copied back every step.
    #[serde(default)]
    pub sample_on_device: bool,
}

fn one() -> u32 {
    1
}

fn unit() -> f64 {
    1.0
}

fn f32_format() -> NumFormat {
    NumFormat::F32
}

/// What an engine sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Wire {
    /// Format of activations in collectives and pipeline hand-offs. Recorded and modeled
    /// timelines carry f32 payloads; bytes on the wire scale by this format's width over 4.
    pub dtype: NumFormat,
}

/// One collective an engine can run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectiveEntry {
    /// Which path and algorithm.
    pub kind: LinkKind,
    /// Bus bandwidth it reaches over the link's figure in the profile (nccl-tests' busbw over
    /// the per-direction link bandwidth).
    pub efficiency: f64,
    /// Fixed cost of one call, microseconds (what a few-byte message takes on few ranks).
    pub latency_us: f64,
    /// Latency each step of a ring adds, microseconds, so that a call's fixed cost grows with
    /// the ranks as NCCL's own tuning model has it (a per-hop latency times the steps): an
    /// all-reduce over p ranks takes 2(p-1) steps, an all-gather or reduce-scatter p-1, a
    /// send/recv one. On `nccl-net`, the latency of a step that crosses nodes. 0 (the default):
    /// the cost of a call does not grow with the ranks (NVLS reduces inside the switch).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub step_latency_us: f64,
    /// `nccl-net` only: latency of each step of the cross-node ring that stays inside a node.
    /// Absent: the `step_latency_us` of the collective the engine runs inside one node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intra_step_latency_us: Option<f64>,
    /// `nccl-net` only: latency of a step between nodes of NCCL's tree all-reduce. Given, an
    /// all-reduce across nodes pays the lesser of the ring's step latencies and the tree's,
    /// `2 x ((ranks per node - 1) x tree_intra_step_latency_us + floor(log2 N) x this)`, as
    /// NCCL picks the faster algorithm for a call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree_step_latency_us: Option<f64>,
    /// `nccl-net` only: latency of a tree step inside a node (absent: the ring's intra-node
    /// step latency).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree_intra_step_latency_us: Option<f64>,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// A collective's path through the machine and its algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkKind {
    /// Every device copies to host memory, the CPU reduces, every device copies the result
    /// back (wgpar's all-reduce). Needs only host links; spans nodes through the network.
    HostStaged,
    /// A ring whose every step bounces through host memory (wgpar's ring).
    HostRing,
    /// A ring over the fastest path the profile has: its device link, else host memory (the
    /// pre-engine model: what the hardware allows with no software loss).
    Ring,
    /// NCCL through host shared memory, for GPUs without peer access.
    NcclShm,
    /// NCCL ring over PCIe peer-to-peer (`host_link.p2p`).
    NcclP2p,
    /// NCCL ring over NVLink / NVSwitch (`[device_link]`).
    NcclRingNvlink,
    /// NCCL NVLS: reduction inside the NVSwitch (`device_link.nvls`).
    NcclNvls,
    /// NCCL across nodes: the inter-node ring over the profile's network.
    NcclNet,
    /// The first device gathers every partial over TCP, reduces and sends the result back
    /// (distributed-llama's root node).
    TcpStar,
}

impl LinkKind {
    /// Name as written in engine files.
    pub fn name(self) -> &'static str {
        match self {
            LinkKind::HostStaged => "host-staged",
            LinkKind::HostRing => "host-ring",
            LinkKind::Ring => "ring",
            LinkKind::NcclShm => "nccl-shm",
            LinkKind::NcclP2p => "nccl-p2p",
            LinkKind::NcclRingNvlink => "nccl-ring-nvlink",
            LinkKind::NcclNvls => "nccl-nvls",
            LinkKind::NcclNet => "nccl-net",
            LinkKind::TcpStar => "tcp-star",
        }
    }

    /// Whether this collective can run among `devices` of `profile`.
    pub fn available(self, profile: &HostProfile, devices: &[usize]) -> bool {
        let nodes = {
            let mut n: Vec<usize> = devices.iter().map(|&d| profile.node_of(d)).collect();
            n.sort_unstable();
            n.dedup();
            n.len()
        };
        let one_node = nodes <= 1;
        match self {
            LinkKind::HostStaged | LinkKind::HostRing | LinkKind::Ring => {
                one_node || profile.network.is_some()
            }
            LinkKind::NcclShm => one_node,
            LinkKind::NcclP2p => {
                one_node
                    && devices
                        .iter()
                        .all(|&d| profile.device(d).is_some_and(|s| s.host_link.p2p))
            }
            LinkKind::NcclRingNvlink => one_node && profile.device_link.is_some(),
            LinkKind::NcclNvls => one_node && profile.device_link.as_ref().is_some_and(|l| l.nvls),
            LinkKind::NcclNet | LinkKind::TcpStar => !one_node && profile.network.is_some(),
        }
    }

    /// Whether this kind runs a ring that the recorded algorithm name `ring` matches.
    pub fn is_ring(self) -> bool {
        matches!(
            self,
            LinkKind::HostRing
                | LinkKind::Ring
                | LinkKind::NcclShm
                | LinkKind::NcclP2p
                | LinkKind::NcclRingNvlink
                | LinkKind::NcclNet
        )
    }
}

impl fmt::Display for LinkKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Name and TOML text of every shipped engine.
pub const SHIPPED_ENGINES: &[(&str, &str)] = &[
    ("wgpar", include_str!("../../hosts/engines/wgpar.toml")),
    (
        "cuda-nccl",
        include_str!("../../hosts/engines/cuda-nccl.toml"),
    ),
];

impl Engine {
    /// Every figure of the profile at 100 %: recorded precision, f32 on the wire, collectives
    /// by the recorded algorithm over any link the profile has. The model as it was before
    /// engines, and an upper bound for any software; what [`super::project`] uses.
    pub fn peak() -> Engine {
        Engine {
            name: "peak".into(),
            label: "peak".into(),
            description: "every figure of the profile at 100 %".into(),
            compute: EngineCompute {
                dtype: NumFormat::F32,
                tensor_cores: false,
                calibrated: true,
                gemm: 1.0,
                attention: 1.0,
                memory: 1.0,
                launch_overhead_us: None,
                attention_query_block: 1,
                kv_dtype: NumFormat::F32,
                memory_fraction: 1.0,
                memory_reserve_bytes: 0,
                kv_preallocated: false,
                vocab_parallel: false,
                sample_on_device: false,
            },
            wire: Wire {
                dtype: NumFormat::F32,
            },
            collectives: vec![
                CollectiveEntry {
                    kind: LinkKind::HostStaged,
                    efficiency: 1.0,
                    latency_us: 0.0,
                    step_latency_us: 0.0,
                    intra_step_latency_us: None,
                    tree_step_latency_us: None,
                    tree_intra_step_latency_us: None,
                },
                CollectiveEntry {
                    kind: LinkKind::Ring,
                    efficiency: 1.0,
                    latency_us: 0.0,
                    step_latency_us: 0.0,
                    intra_step_latency_us: None,
                    tree_step_latency_us: None,
                    tree_intra_step_latency_us: None,
                },
            ],
        }
    }

    /// The label reports print (the name when the file gives none).
    pub fn label(&self) -> &str {
        if self.label.trim().is_empty() {
            &self.name
        } else {
            &self.label
        }
    }

    /// Bytes on the wire per recorded (f32) byte.
    pub fn wire_scale(&self) -> f64 {
        self.wire.dtype.bytes() / 4.0
    }

    /// Reads and validates an engine file.
    pub fn load(path: impl AsRef<Path>) -> Result<Engine, ProfileError> {
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

    /// Parses and validates engine text; `file` names the source in errors.
    pub fn from_toml_str(text: &str, file: &str) -> Result<Engine, ProfileError> {
        rules::parse_checked(text, file, Engine::check)
    }

    /// Checks an engine built in code.
    pub fn validate(&self) -> Result<(), ProfileError> {
        self.check()
            .map_err(|v| rules::unlocated(&format!("<engine {}>", self.name), v))
    }

    /// A shipped engine by name (`"cuda-nccl"`).
    pub fn shipped(name: &str) -> Result<Engine, ProfileError> {
        match SHIPPED_ENGINES.iter().find(|(n, _)| *n == name) {
            Some((n, text)) => Engine::from_toml_str(text, &format!("hosts/engines/{n}.toml")),
            None if name == "peak" => Ok(Engine::peak()),
            None => Err(unknown(name)),
        }
    }

    /// A shipped engine when `name_or_path` is exactly its name (`wgpar`, even with a file of
    /// that name in the working folder: write `./wgpar` for the file), else an engine file if
    /// one exists there, else a shipped engine by the file's stem.
    pub fn resolve(name_or_path: &str) -> Result<Engine, ProfileError> {
        let shipped_name =
            name_or_path == "peak" || SHIPPED_ENGINES.iter().any(|(n, _)| *n == name_or_path);
        if shipped_name {
            return Engine::shipped(name_or_path);
        }
        if Path::new(name_or_path).is_file() {
            return Engine::load(name_or_path);
        }
        let stem = name_or_path.strip_suffix(".toml").unwrap_or(name_or_path);
        let stem = stem.rsplit('/').next().unwrap_or(stem);
        if stem == "peak" || SHIPPED_ENGINES.iter().any(|(n, _)| *n == stem) {
            Engine::shipped(stem)
        } else {
            Err(unknown(name_or_path))
        }
    }

    /// The engine's collective for `devices` of `profile`: among the entries the machine
    /// allows, the one whose algorithm matches `recorded` (`host-staged`, `ring`) when given
    /// and present, else the first. `None` when no entry is allowed.
    pub fn collective_for(
        &self,
        profile: &HostProfile,
        devices: &[usize],
        recorded: Option<&str>,
    ) -> Option<&CollectiveEntry> {
        let allowed: Vec<&CollectiveEntry> = self
            .collectives
            .iter()
            .filter(|c| c.kind.available(profile, devices))
            .collect();
        let matching = recorded.and_then(|r| {
            let r = r.to_ascii_lowercase();
            allowed.iter().copied().find(|c| match r.as_str() {
                "host-staged" | "host_staged" | "host" | "host-staged-chunked" => {
                    c.kind == LinkKind::HostStaged
                }
                "ring" | "nvlink-ring" => c.kind.is_ring(),
                other => c.kind.name() == other,
            })
        });
        matching.or_else(|| allowed.first().copied())
    }

    fn check(&self) -> Result<(), Violation> {
        let root = FieldPath::root();
        rules::non_empty(&root.key("name"), &self.name)?;
        let c = root.key("compute");
        let dtype_ok = matches!(
            self.compute.dtype,
            NumFormat::F32 | NumFormat::F16 | NumFormat::Bf16 | NumFormat::Fp8
        );
        if !dtype_ok {
            return Err(Violation::new(
                c.key("dtype"),
                self.compute.dtype,
                "arithmetic must be f32, f16, bf16 or fp8 (quantized weights are dequantized \
                 to one of these)",
            ));
        }
        rules::fraction(&c.key("gemm"), self.compute.gemm)?;
        rules::fraction(&c.key("attention"), self.compute.attention)?;
        rules::fraction(&c.key("memory"), self.compute.memory)?;
        rules::fraction(&c.key("memory_fraction"), self.compute.memory_fraction)?;
        if let Some(l) = self.compute.launch_overhead_us {
            rules::latency_us(&c.key("launch_overhead_us"), l)?;
        }
        rules::at_least_one(
            &c.key("attention_query_block"),
            self.compute.attention_query_block as u64,
        )?;
        if self.compute.memory_reserve_bytes > 1_000_000_000_000_000 {
            return Err(Violation::new(
                c.key("memory_reserve_bytes"),
                self.compute.memory_reserve_bytes,
                "must be at most 1000000000000000 bytes (1 PB)",
            ));
        }
        if self.collectives.is_empty() {
            return Err(Violation::new(
                root.key("collectives"),
                "[]",
                "an engine needs at least one [[collectives]] entry",
            ));
        }
        for (i, e) in self.collectives.iter().enumerate() {
            let p = root.key("collectives").index(i);
            rules::efficiency(&p.key("efficiency"), e.efficiency)?;
            rules::latency_us(&p.key("latency_us"), e.latency_us)?;
            rules::latency_us(&p.key("step_latency_us"), e.step_latency_us)?;
            let net_only = [
                ("intra_step_latency_us", e.intra_step_latency_us),
                ("tree_step_latency_us", e.tree_step_latency_us),
                ("tree_intra_step_latency_us", e.tree_intra_step_latency_us),
            ];
            for (key, value) in net_only {
                let Some(v) = value else { continue };
                let field = p.key(key);
                if e.kind != LinkKind::NcclNet {
                    return Err(Violation::new(
                        field,
                        v,
                        "applies only to kind = \"nccl-net\" (steps of a collective across \
                         nodes)",
                    ));
                }
                rules::latency_us(&field, v)?;
            }
            if self.collectives[..i].iter().any(|o| o.kind == e.kind) {
                return Err(Violation::new(
                    p.key("kind"),
                    e.kind,
                    "each kind may appear once",
                ));
            }
        }
        Ok(())
    }
}

fn unknown(name: &str) -> ProfileError {
    ProfileError::UnknownEngine {
        name: name.to_owned(),
        known: std::iter::once("peak")
            .chain(SHIPPED_ENGINES.iter().map(|(n, _)| *n))
            .collect::<Vec<_>>()
            .join(", "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_engines_parse() {
        for (name, _) in SHIPPED_ENGINES {
            let e = Engine::shipped(name).unwrap_or_else(|err| panic!("{err}"));
            assert_eq!(&e.name, name);
        }
        Engine::peak().validate().unwrap();
        assert!(Engine::resolve("hosts/engines/cuda-nccl.toml").is_ok());
        let e = Engine::resolve("nope").unwrap_err().to_string();
        assert!(e.contains("cuda-nccl") && e.contains("nope"), "{e}");
    }

    #[test]
    fn wgpar_goes_through_the_host_even_with_nvlink() {
        let dgx = HostProfile::shipped("dgx-h100").unwrap();
        let wgpar = Engine::shipped("wgpar").unwrap();
        let cuda = Engine::shipped("cuda-nccl").unwrap();
        let devs = [0, 1, 2, 3];
        let w = wgpar
            .collective_for(&dgx, &devs, Some("host-staged"))
            .unwrap();
        assert_eq!(w.kind, LinkKind::HostStaged);
        // wgpar's own ring bounces through host memory too.
        let w = wgpar.collective_for(&dgx, &devs, Some("ring")).unwrap();
        assert_eq!(w.kind, LinkKind::HostRing);
        // CUDA + NCCL takes the best the hardware allows: NVLS on an H100 NVSwitch.
        let c = cuda
            .collective_for(&dgx, &devs, Some("host-staged"))
            .unwrap();
        assert_eq!(c.kind, LinkKind::NcclNvls);
        let a100 = HostProfile::shipped("dgx-a100").unwrap();
        let c = cuda.collective_for(&a100, &devs, None).unwrap();
        assert_eq!(c.kind, LinkKind::NcclRingNvlink);
        // A GeForce box: no P2P, so NCCL goes through host shared memory.
        let pcie = HostProfile::shipped("pcie4-2gpu").unwrap();
        let c = cuda.collective_for(&pcie, &[0, 1], None).unwrap();
        assert_eq!(c.kind, LinkKind::NcclShm);
        // Across nodes only the network kinds apply.
        let ib = HostProfile::shipped("2node-ib200").unwrap();
        let c = cuda.collective_for(&ib, &[3, 4], None).unwrap();
        assert_eq!(c.kind, LinkKind::NcclNet);
    }
}

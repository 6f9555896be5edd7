//! Engines: every shipped engine file parses and names its sources, broken engine files are
//! reported with file, line and field, and a projection with a tensor-core engine and an f16
//! wire matches a schedule worked out by hand.

use std::path::Path;

use wgpar::sim::{
    project, project_engine, Engine, HostProfile, LinkKind, ProfileError, ProjectOptions,
    SHIPPED_ENGINES,
};
use wgpar::trace::{CollectiveOp, KernelFamily, SpanAttrs, Timeline};

#[test]
fn every_engine_file_parses_is_shipped_and_sources_its_figures() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("hosts/engines");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .map(|p| {
            let e = Engine::load(&p).unwrap_or_else(|err| panic!("{err}"));
            let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
            assert_eq!(e.name, stem);
            stem
        })
        .collect();
    on_disk.sort();
    let mut shipped: Vec<String> = SHIPPED_ENGINES.iter().map(|(n, _)| n.to_string()).collect();
    shipped.sort();
    assert_eq!(on_disk, shipped);
    for required in ["wgpar", "cuda-nccl"] {
        assert!(shipped.iter().any(|s| s == required), "{required}");
    }
    // Every figure line has a comment above it naming where it comes from.
    for (name, text) in SHIPPED_ENGINES {
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim();
            if t.starts_with('#') || t.starts_with('[') || t.is_empty() {
                continue;
            }
            let (key, value) = t.split_once('=').unwrap();
            let value = value.trim();
            let descriptive = ["name", "label", "description", "kind"].contains(&key.trim());
            if !descriptive {
                assert!(
                    lines[i - 1].trim_start().starts_with('#'),
                    "{name}.toml line {}: `{t}` has no source comment above it",
                    i + 1
                );
            }
            assert!(!value.is_empty(), "{name}.toml line {}", i + 1);
        }
    }
}

fn cuda() -> String {
    SHIPPED_ENGINES
        .iter()
        .find(|(n, _)| *n == "cuda-nccl")
        .unwrap()
        .1
        .to_owned()
}

fn line_of(text: &str, needle: &str) -> usize {
    text.lines().position(|l| l.contains(needle)).unwrap() + 1
}

#[test]
fn malformed_engine_files_name_file_line_and_field() {
    // A wrong type.
    let text = cuda().replace("gemm = 0.8", "gemm = \"fast\"");
    let err = Engine::from_toml_str(&text, "e.toml").unwrap_err();
    assert!(matches!(err, ProfileError::Parse { .. }), "{err:?}");
    assert_eq!(err.field(), Some("compute.gemm"));
    assert_eq!(
        err.location().unwrap().line,
        Some(line_of(&text, "\"fast\""))
    );
    assert!(err.to_string().starts_with("e.toml:"), "{err}");

    // A fraction above 1.
    let text = cuda().replace("memory = 0.84", "memory = 1.5");
    let err = Engine::from_toml_str(&text, "e.toml").unwrap_err();
    assert!(matches!(err, ProfileError::Invalid { .. }), "{err:?}");
    assert_eq!(err.field(), Some("compute.memory"));
    assert_eq!(
        err.location().unwrap().line,
        Some(line_of(&text, "memory = 1.5"))
    );
    assert!(err.to_string().contains("fraction"), "{err}");

    // An efficiency of zero in the second collective.
    let text = cuda().replacen("efficiency = 0.8\n", "efficiency = 0\n", 1);
    let err = Engine::from_toml_str(&text, "e.toml").unwrap_err();
    assert_eq!(err.field(), Some("collectives[1].efficiency"));
    let line = text
        .lines()
        .position(|l| l.trim() == "efficiency = 0")
        .unwrap()
        + 1;
    assert_eq!(err.location().unwrap().line, Some(line));

    // A missing field names its table.
    let text = cuda().replace("attention = 0.5\n", "");
    let err = Engine::from_toml_str(&text, "e.toml").unwrap_err();
    assert_eq!(err.field(), Some("compute.attention"), "{err}");

    // An unknown field and an unknown collective kind.
    let text = cuda().replace("gemm = 0.8", "gemm = 0.8\nsparsity = 2");
    let err = Engine::from_toml_str(&text, "e.toml").unwrap_err();
    assert_eq!(err.field(), Some("compute.sparsity"), "{err}");
    let text = cuda().replace("kind = \"nccl-p2p\"", "kind = \"carrier-pigeon\"");
    let err = Engine::from_toml_str(&text, "e.toml").unwrap_err();
    assert_eq!(
        err.location().unwrap().line,
        Some(line_of(&text, "carrier-pigeon")),
        "{err}"
    );
    assert!(err.to_string().contains("carrier-pigeon"), "{err}");

    // A kind listed twice (the later one is named), a dtype that is no arithmetic, a syntax
    // error.
    let text = cuda().replace("kind = \"nccl-p2p\"", "kind = \"nccl-shm\"");
    let err = Engine::from_toml_str(&text, "e.toml").unwrap_err();
    assert_eq!(err.field(), Some("collectives[3].kind"), "{err}");
    let text = cuda().replacen("dtype = \"f16\"", "dtype = \"q4_0\"", 1);
    let err = Engine::from_toml_str(&text, "e.toml").unwrap_err();
    assert_eq!(err.field(), Some("compute.dtype"), "{err}");
    let err =
        Engine::from_toml_str("name = \"x\"\n[compute]\ngemm = 0.5 0.5\n", "s.toml").unwrap_err();
    assert_eq!(err.location().unwrap().line, Some(3), "{err}");
    assert_eq!(err.field(), Some("compute.gemm"));

    // Files and names.
    let err = Engine::load("no/such/engine.toml").unwrap_err().to_string();
    assert!(err.contains("engine.toml"), "{err}");
    let err = Engine::resolve("tensorrt").unwrap_err().to_string();
    assert!(
        err.contains("tensorrt") && err.contains("cuda-nccl"),
        "{err}"
    );
}

/// Two devices: f32 1 TFLOP/s, f16 shader 2, f16 tensor 10 TFLOP/s; 1000 GB/s memory; 2 us
/// launches; host links 10 us + 10 GB/s; host memory 10 GB/s; NVLink-like 100 GB/s.
fn profile() -> HostProfile {
    let text = "name = \"hand\"\nnodes = 1\n[host]\nname = \"c\"\nmemory_gbps = 10\n\
        [[devices]]\nname = \"g\"\ncount = 2\nmemory_bytes = 1000000000\nmemory_gbps = 1000\n\
        f32_tflops = 1\nf16_tflops = 2\nf16_tensor_tflops = 10\nlaunch_overhead_us = 2\n\
        [devices.host_link]\nname = \"pcie\"\nshared_by = 1\n\
        h2d = { alpha_us = 10, beta_gbps = 10 }\nd2h = { alpha_us = 10, beta_gbps = 10 }\n\
        [device_link]\nname = \"nv\"\nalpha_us = 10\nbeta_gbps = 100\n";
    HostProfile::from_toml_str(text, "hand.toml").unwrap()
}

/// An engine on tensor cores at half their peak, f16 on the wire, an NVLink ring at half the
/// link with 5 us per call, 1 us per launch.
fn tensor_engine() -> Engine {
    let text = "name = \"t\"\n[compute]\ndtype = \"f16\"\ntensor_cores = true\ngemm = 0.5\n\
        attention = 0.25\nmemory = 0.5\nlaunch_overhead_us = 1\n[wire]\ndtype = \"f16\"\n\
        [[collectives]]\nkind = \"nccl-ring-nvlink\"\nefficiency = 0.5\nlatency_us = 5\n\
        [[collectives]]\nkind = \"host-staged\"\nefficiency = 1\nlatency_us = 0\n";
    Engine::from_toml_str(text, "t.toml").unwrap()
}

/// One tensor-parallel layer half per device: a matmul of 50 MFLOP over 1 MB, an attention
/// of 10 MFLOP over 0.1 MB, then an all-reduce of 1 MB (recorded as f32).
fn layer() -> Timeline {
    let mut t = Timeline::new();
    let mut ends = Vec::new();
    for dev in 0..2u32 {
        let mm = t.push_us(
            SpanAttrs::compute("mlp", dev)
                .flops(50_000_000)
                .bytes(1_000_000)
                .kernels(2)
                .family(KernelFamily::Matmul),
            0.0,
            500.0,
        );
        let at = t.push_us(
            SpanAttrs::compute("attention", dev)
                .flops(10_000_000)
                .bytes(100_000)
                .kernels(1)
                .family(KernelFamily::Attention)
                .after(mm),
            500.0,
            100.0,
        );
        ends.push(at);
    }
    for dev in 0..2u32 {
        t.push_us(
            SpanAttrs::collective(
                "allreduce",
                dev,
                CollectiveOp::AllReduce,
                "host-staged",
                2,
                1_000_000,
            )
            .group(0)
            .after(ends[dev as usize]),
            600.0,
            300.0,
        );
    }
    t
}

#[test]
fn tensor_core_engine_with_an_f16_wire_by_hand() {
    let p = profile();
    let e = tensor_engine();
    // Matmul: 50 MFLOP at 10 TFLOP/s x 0.5 = 10 us (1 MB at 1000 GB/s x 0.5 = 2 us is less)
    // + 2 launches x 1 us = 12. Attention: 10 MFLOP at 10 x 0.25 TFLOP/s = 4 us + 1 = 5.
    // As recorded (host-staged, which the engine has): 1 MB recorded in f32 is 0.5 MB in f16;
    // d2h 10 + 50, reduce 3 x 0.5 MB at 10 GB/s = 150, h2d 60: 270 us.
    let proj = project_engine(&layer(), &p, &e, &ProjectOptions::default()).unwrap();
    let r = &proj.report;
    assert!(
        (r.projected.makespan_us - (17.0 + 270.0)).abs() < 1e-9,
        "{r}"
    );
    assert_eq!(r.collectives_via, ["host-staged"]);
    assert_eq!(r.engine, "t");
    // The cheapest the engine has: the NVLink ring, 2(n-1)/n = 1 x 0.5 MB at 100 GB/s x 0.5 =
    // 10 us, + 5 us per call.
    let best = ProjectOptions {
        collectives: wgpar::sim::CollectivePolicy::Best,
        ..Default::default()
    };
    let proj = project_engine(&layer(), &p, &e, &best).unwrap();
    assert!(
        (proj.report.projected.makespan_us - (17.0 + 15.0)).abs() < 1e-9,
        "{}",
        proj.report
    );
    assert_eq!(proj.report.collectives_via, ["nccl-ring-nvlink"]);
    // The peak engine keeps f32 shader cores and the f32 payload: 50 + 2 x 2 = 54 and 10 + 2 =
    // 12 us of compute, then the host path of 1 MB: 110 + 300 + 110 us.
    let peak = project(&layer(), &p, &ProjectOptions::default()).unwrap();
    assert!(
        (peak.report.projected.makespan_us - (66.0 + 520.0)).abs() < 1e-9,
        "{}",
        peak.report
    );
    assert_eq!(peak.report.engine, "peak");
}

#[test]
fn wgpar_stays_on_the_host_path_where_cuda_uses_nvlink() {
    let dgx = HostProfile::shipped("dgx-a100").unwrap();
    let t = layer();
    let wgpar = Engine::shipped("wgpar").unwrap();
    let cuda = Engine::shipped("cuda-nccl").unwrap();
    let best = ProjectOptions {
        collectives: wgpar::sim::CollectivePolicy::Best,
        ..Default::default()
    };
    // Even asked for its cheapest collective, wgpar stays on a path through host memory.
    let w = project_engine(&t, &dgx, &wgpar, &best).unwrap();
    assert!(
        w.report.collectives_via == ["host-staged"] || w.report.collectives_via == ["host-ring"],
        "{:?}",
        w.report.collectives_via
    );
    let c = project_engine(&t, &dgx, &cuda, &ProjectOptions::default()).unwrap();
    assert_eq!(c.report.collectives_via, ["nccl-ring-nvlink"]);
    assert!(c.report.projected.makespan_us < w.report.projected.makespan_us);
    // Every shipped engine runs a two-device layer on every shipped profile that has two.
    for (name, _) in SHIPPED_ENGINES {
        let e = Engine::shipped(name).unwrap();
        for (pname, _) in wgpar::sim::SHIPPED_PROFILES {
            let p = HostProfile::shipped(pname).unwrap();
            if p.device_count() >= 2 {
                let r = project_engine(&t, &p, &e, &ProjectOptions::default())
                    .unwrap_or_else(|err| panic!("{name} on {pname}: {err}"));
                assert!(r.report.projected.makespan_us > 0.0);
            }
        }
    }
    assert_eq!(
        cuda.collective_for(&dgx, &[0, 1], None).map(|c| c.kind),
        Some(LinkKind::NcclRingNvlink)
    );
}

/// Four devices per node, 100 GB/s NVLink-like device link; `nodes` nodes joined by a 5 GB/s
/// network with one interface per node.
fn ranks_profile(nodes: u32) -> HostProfile {
    let text = format!(
        "name = \"steps\"\nnodes = {nodes}\n[host]\nname = \"c\"\nmemory_gbps = 10\n\
         [[devices]]\nname = \"g\"\ncount = 4\nmemory_bytes = 1000000000\nmemory_gbps = 1000\n\
         f32_tflops = 1\nf16_tflops = 2\nlaunch_overhead_us = 2\n\
         [devices.host_link]\nname = \"pcie\"\nshared_by = 1\n\
         h2d = {{ alpha_us = 10, beta_gbps = 10 }}\nd2h = {{ alpha_us = 10, beta_gbps = 10 }}\n\
         [device_link]\nname = \"nv\"\nalpha_us = 10\nbeta_gbps = 100\n\
         [network]\nname = \"net\"\nalpha_us = 20\nbeta_gbps = 5\n"
    );
    HostProfile::from_toml_str(&text, "steps.toml").unwrap()
}

/// f16 on the wire; an NVLink ring at half the link, 5 us per call and 0.5 us per ring step;
/// a network ring at the full figure, 20 us per call, 2 us per step between nodes, 0.25 us per
/// step inside one, and the given tree steps.
fn stepped_engine(tree: &str) -> Engine {
    let text = format!(
        "name = \"s\"\n[compute]\ndtype = \"f16\"\ngemm = 0.5\nattention = 0.5\nmemory = 0.5\n\
         [wire]\ndtype = \"f16\"\n\
         [[collectives]]\nkind = \"nccl-ring-nvlink\"\nefficiency = 0.5\nlatency_us = 5\n\
         step_latency_us = 0.5\n\
         [[collectives]]\nkind = \"nccl-net\"\nefficiency = 1\nlatency_us = 20\n\
         step_latency_us = 2\nintra_step_latency_us = 0.25\n{tree}"
    );
    Engine::from_toml_str(&text, "s.toml").unwrap()
}

/// The all-reduce of `bytes` (as recorded, f32) over `devices` of `profile` with `engine`:
/// microseconds and the link kind it took.
fn engine_all_reduce_us(
    profile: &HostProfile,
    engine: &Engine,
    devices: &[usize],
    bytes: u64,
) -> (f64, LinkKind) {
    use wgpar::sim::{CollectivePolicy, CostModel};
    CostModel::with_engine(profile, engine)
        .engine_collective_us(
            CollectiveOp::AllReduce,
            "auto",
            CollectivePolicy::AsRecorded,
            devices,
            bytes,
            1,
        )
        .unwrap()
}

#[test]
fn ring_step_latency_grows_with_the_ranks_by_hand() {
    use wgpar::sim::{CollectivePolicy, CostModel};
    let p = ranks_profile(1);
    let e = stepped_engine("");
    let m = CostModel::with_engine(&p, &e);
    let ar = |devices: &[usize], bytes: u64| engine_all_reduce_us(&p, &e, devices, bytes);
    // 4 kB recorded in f32 is 2 kB on the f16 wire. Two ranks: 2(n-1)/n = 1 x 2 kB at
    // 100 GB/s x 0.5 = 0.04 us; 5 us per call; 2 steps x 0.5 us = 1 us.
    let (t, kind) = ar(&[0, 1], 4000);
    assert_eq!(kind, LinkKind::NcclRingNvlink);
    assert!((t - 6.04).abs() < 1e-9, "{t}");
    // Four ranks: 1.5 x 2 kB = 0.06 us; 6 steps x 0.5 = 3 us on top of the 5 us call.
    let (t, _) = ar(&[0, 1, 2, 3], 4000);
    assert!((t - 8.06).abs() < 1e-9, "{t}");
    // An all-gather over four ranks takes n-1 = 3 steps: 0.75 x 2 kB = 0.03 us + 5 + 1.5.
    let (t, _) = m
        .engine_collective_us(
            CollectiveOp::AllGather,
            "auto",
            CollectivePolicy::AsRecorded,
            &[0, 1, 2, 3],
            4000,
            1,
        )
        .unwrap();
    assert!((t - 6.53).abs() < 1e-9, "{t}");

    // Across two nodes of four: 8 ranks, 14 ring steps; NCCL counts 2N = 4 of them as
    // crossing nodes: 4 x 2 + 10 x 0.25 = 10.5 us. Bytes: 1.75 x 2 kB at min(100, 1 x 5)
    // GB/s = 0.7 us; + 20 us per call.
    let p = ranks_profile(2);
    let all: Vec<usize> = (0..8).collect();
    let (t, kind) = engine_all_reduce_us(&p, &e, &all, 4000);
    assert_eq!(kind, LinkKind::NcclNet);
    assert!((t - 31.2).abs() < 1e-9, "{t}");
    // With tree steps of 1 us between nodes and 0.5 inside: 2 x (3 x 0.5 + 1 x 1) = 5 us beats
    // the ring's 10.5.
    let e = stepped_engine("tree_step_latency_us = 1\ntree_intra_step_latency_us = 0.5\n");
    let (t, _) = engine_all_reduce_us(&p, &e, &all, 4000);
    assert!((t - 25.7).abs() < 1e-9, "{t}");
    // A slow tree (5 us between nodes: 2 x (1.5 + 5) = 13 us) loses to the ring again.
    let e = stepped_engine("tree_step_latency_us = 5\ntree_intra_step_latency_us = 0.5\n");
    let (t, _) = engine_all_reduce_us(&p, &e, &all, 4000);
    assert!((t - 31.2).abs() < 1e-9, "{t}");
    // Without an intra-node figure the network ring's inside steps take the NVLink entry's
    // 0.5 us: 4 x 2 + 10 x 0.5 = 13 us.
    let text = "name = \"s\"\n[compute]\ndtype = \"f16\"\ngemm = 0.5\nattention = 0.5\n\
        memory = 0.5\n[wire]\ndtype = \"f16\"\n\
        [[collectives]]\nkind = \"nccl-ring-nvlink\"\nefficiency = 0.5\nlatency_us = 5\n\
        step_latency_us = 0.5\n\
        [[collectives]]\nkind = \"nccl-net\"\nefficiency = 1\nlatency_us = 20\n\
        step_latency_us = 2\n";
    let e = Engine::from_toml_str(text, "s.toml").unwrap();
    let (t, _) = engine_all_reduce_us(&p, &e, &all, 4000);
    assert!((t - 33.7).abs() < 1e-9, "{t}");
}

#[test]
fn step_latency_fields_parse_and_malformed_ones_name_file_line_and_field() {
    // The shipped engine carries them: NVLink ring steps, none on NVLS, network and tree
    // steps on nccl-net.
    let e = Engine::shipped("cuda-nccl").unwrap();
    let entry = |k: LinkKind| e.collectives.iter().find(|c| c.kind == k).unwrap();
    assert!(entry(LinkKind::NcclRingNvlink).step_latency_us > 0.0);
    assert_eq!(entry(LinkKind::NcclNvls).step_latency_us, 0.0);
    let net = entry(LinkKind::NcclNet);
    assert!(net.intra_step_latency_us.is_some() && net.tree_step_latency_us.is_some());
    // Absent, it is 0 (the wgpar engine has none).
    let w = Engine::shipped("wgpar").unwrap();
    assert!(!w.collectives.is_empty());
    assert!(w.collectives.iter().all(|c| c.step_latency_us == 0.0));

    // A negative step latency.
    let text = cuda().replace("step_latency_us = 0.47", "step_latency_us = -1");
    let err = Engine::from_toml_str(&text, "e.toml").unwrap_err();
    assert!(matches!(err, ProfileError::Invalid { .. }), "{err:?}");
    assert_eq!(err.field(), Some("collectives[1].step_latency_us"), "{err}");
    assert_eq!(
        err.location().unwrap().line,
        Some(line_of(&text, "step_latency_us = -1"))
    );
    assert!(err.to_string().starts_with("e.toml:"), "{err}");
    // A wrong type.
    let text = cuda().replace("step_latency_us = 2.7", "step_latency_us = \"slow\"");
    let err = Engine::from_toml_str(&text, "e.toml").unwrap_err();
    assert!(matches!(err, ProfileError::Parse { .. }), "{err:?}");
    assert_eq!(err.field(), Some("collectives[4].step_latency_us"), "{err}");
    assert_eq!(
        err.location().unwrap().line,
        Some(line_of(&text, "\"slow\""))
    );
    // Network-only fields on a collective inside one node are refused, not ignored.
    let text = cuda().replace(
        "step_latency_us = 1.0\n",
        "step_latency_us = 1.0\ntree_step_latency_us = 5\n",
    );
    let err = Engine::from_toml_str(&text, "e.toml").unwrap_err();
    assert_eq!(
        err.field(),
        Some("collectives[2].tree_step_latency_us"),
        "{err}"
    );
    assert_eq!(
        err.location().unwrap().line,
        Some(line_of(&text, "tree_step_latency_us = 5"))
    );
    assert!(err.to_string().contains("nccl-net"), "{err}");
    // An out-of-range intra-node step on nccl-net.
    let text = cuda().replace(
        "intra_step_latency_us = 0.85",
        "intra_step_latency_us = 1e9",
    );
    let err = Engine::from_toml_str(&text, "e.toml").unwrap_err();
    assert_eq!(
        err.field(),
        Some("collectives[4].intra_step_latency_us"),
        "{err}"
    );
    assert_eq!(
        err.location().unwrap().line,
        Some(line_of(&text, "intra_step_latency_us = 1e9"))
    );
}

//! The benchmark on two virtual devices: small sizes, few iterations; checks the report's shape,
//! its correctness column and JSON output.

use wgpar::comm::bench::{run_bench, BenchOp, BenchOptions};
use wgpar::comm::units::parse_size;
use wgpar::comm::Algorithm;
use wgpar::device::{open_devices, Adapters, DType, DeviceSelection, GpuOptions};

#[test]
fn bench_prints_nccl_tests_table_and_checks_results() {
    let adapters = Adapters::discover().expect("no adapter: install mesa-vulkan-drivers");
    let selection = DeviceSelection::Virtual {
        adapter: adapters.preferred(),
        count: 2,
    };
    let gpus = open_devices(&adapters, &selection, &GpuOptions::default()).unwrap();
    for (op, dtype) in [
        (BenchOp::AllReduce, DType::F32),
        (BenchOp::AllGather, DType::F16),
        (BenchOp::ReduceScatter, DType::F32),
        (BenchOp::SendRecv, DType::F16),
    ] {
        let opts = BenchOptions {
            min_bytes: parse_size("8").unwrap(),
            max_bytes: parse_size("512K").unwrap(),
            factor: 8,
            iters: 3,
            warmup: 1,
            op,
            dtype,
            algorithm: Algorithm::Auto,
            ..BenchOptions::default()
        };
        let report = run_bench(&gpus, &opts).unwrap();
        let text = report.to_string();
        assert_eq!(report.wrong_total, 0, "{text}");
        // 8, 64, 512, 4K, 32K, 256K (gather ops round 8 B up to one element per rank).
        assert_eq!(report.rows.len(), 6, "{text}");
        assert!(text.contains("size") && text.contains("busbw") && text.contains("#wrong"));
        assert!(text.contains("# Out of bounds values : 0 OK"), "{text}");
        assert!(text.contains("# Avg bus bandwidth"), "{text}");
        assert!(text.contains("gpu1"), "{text}");
        let last = report.rows.last().unwrap();
        assert_eq!(last.size, 256 << 10);
        assert!(last.time_us > 0.0 && last.floor_us > 0.0 && last.p99_us >= last.p50_us);
        let factor = match op {
            BenchOp::AllReduce => 1.0,
            BenchOp::SendRecv => 1.0,
            _ => 0.5,
        };
        assert!((last.busbw - last.algbw * factor).abs() < 1e-9);
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["rows"].as_array().map(|r| r.len()), Some(6));
    }
}

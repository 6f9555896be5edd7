//! KV copies between slots (`BatchStep::kv_copies`) over MPI ranks: a pipeline whose stages
//! span two ranks, driven through rank 0's `StepEngine`, copies a prefix on every rank (each
//! its own layers, the copies carried in the stage link's pass header) and gives the logits
//! and greedy tokens of the same prefix computed in place; bad copies are refused on rank 0
//! before anything travels, and the pipeline serves on. Block tables travel the same way:
//! slots scattered over the pool on every rank give the logits of contiguous ones. The test
//! binary runs itself as the ranks under `mpirun`. Needs `--features mpi` and Open MPI's
//! `mpirun`; CI runs it (`.ci/run`).
#![cfg(feature = "mpi")]

mod common;
mod kv_copy_support;

use std::process::Command;
use std::time::Duration;

use kv_copy_support::{
    bad_copies_are_refused, bad_tables_are_refused, copy_matches_recompute, llama,
    scattered_blocks_match_contiguous, SLOTS,
};
use wgpar::comm::CommConfig;
use wgpar::device::DType;
use wgpar::dist::{self, World};
use wgpar::model::ModelWeights;
use wgpar::parallel::{PartitionSpec, Schedule, Strategy};

/// Set in the ranks' environment: the test then runs as a rank instead of launching them.
const AS_RANK: &str = "WGPAR_TEST_KV_COPY_RANK";
const DONE: &str = "kv copies over ranks: compared";

#[test]
fn a_prefix_copied_on_every_rank_gives_the_tokens_of_one_computed_in_place() {
    if std::env::var_os(AS_RANK).is_some() {
        return as_rank();
    }
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .args(["-x", AS_RANK])
        .env(AS_RANK, "1")
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_prefix_copied_on_every_rank_gives_the_tokens_of_one_computed_in_place",
            "--test-threads=1",
            "--nocapture",
        ])
        .output()
        .expect("mpirun runs (install Open MPI: openmpi-bin)");
    let text = format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains(&format!("{DONE} 3")), "{text}");
}

/// One rank: rank 0 drives the pipeline's steps, rank 1 serves its stage until rank 0 stops.
fn as_rank() {
    let world = World::init(Duration::from_secs(120)).unwrap();
    let gpus = common::gpus(1);
    let weights = ModelWeights::synthetic(&llama(), 31);
    let strategy = Strategy::Pipeline {
        partition: PartitionSpec::Even,
        micro_batches: 2,
        schedule: Schedule::InFlight,
    };
    let config = CommConfig::default();
    let engine = dist::build(&world, &strategy, &gpus, &weights, DType::F32, &config).unwrap();
    dist::job::serve_rank(&world, engine, None, |mut e| {
        e.reserve_slots(SLOTS)?;
        let mut compared = 0;
        for (k, len) in [(7, 12), (29, 33)] {
            let gap = copy_matches_recompute("pp over 2 ranks", e.as_mut(), k, len);
            assert!(gap <= 1e-5, "k={k}: logits differ by {gap}");
            compared += 1;
        }
        bad_copies_are_refused("pp over 2 ranks", e.as_mut());
        // Block tables travel in the pass header too: scattered blocks on every rank.
        let gap = scattered_blocks_match_contiguous("pp over 2 ranks", e.as_mut());
        assert!(gap <= 1e-5, "scattered blocks: logits differ by {gap}");
        bad_tables_are_refused("pp over 2 ranks", e.as_mut());
        compared += 1;
        println!("{DONE} {compared}");
        Ok(())
    })
    .unwrap();
    world.finish();
}

//! A wgpar built without the `mpi` feature refuses to run as N copies under an MPI launcher.
#![cfg(not(feature = "mpi"))]

use std::process::Command;

#[test]
fn a_build_without_mpi_refuses_a_parallel_launch() {
    let o = Command::new(env!("CARGO_BIN_EXE_wgpar"))
        .args(["run", "--model", "tiny-llama"])
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .env("OMPI_COMM_WORLD_RANK", "1")
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("rank 1 of 2") && err.contains("--features mpi"),
        "{err}"
    );
    let o = Command::new(env!("CARGO_BIN_EXE_wgpar"))
        .args(["--mpi", "devices"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--features mpi"));
    // One rank is not a parallel launch: it runs.
    let o = Command::new(env!("CARGO_BIN_EXE_wgpar"))
        .args(["devices", "--json"])
        .env("PMI_SIZE", "1")
        .env("PMI_RANK", "0")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

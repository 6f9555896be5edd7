//! Whether this process was started by an MPI launcher, read from the environment the
//! launcher sets. Compiled without the `mpi` feature too, so that a binary built without it
//! can refuse to run as N independent copies under `mpirun`.

/// What the launcher told this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Ranks in the job.
    pub size: usize,
    /// This process's rank (0-based).
    pub rank: usize,
    /// This process's rank among the ranks on its machine (0-based), where the launcher says.
    pub local_rank: Option<usize>,
    /// Which launcher variables were found, e.g. `Open MPI (OMPI_COMM_WORLD_SIZE)`.
    pub launcher: String,
}

/// Reads the launch from the process environment (`None`: not started by an MPI launcher).
pub fn detect() -> Option<Launch> {
    detect_from(|k| std::env::var(k).ok())
}

/// [`detect`] over any variable lookup (for tests).
pub fn detect_from(get: impl Fn(&str) -> Option<String>) -> Option<Launch> {
    let num = |k: &str| get(k).and_then(|v| v.trim().parse::<usize>().ok());
    // Open MPI's mpirun (and its PRRTE successor), then MPICH / Intel MPI's Hydra (PMI), then
    // a PMIx launcher that only exports the rank (srun --mpi=pmix).
    let candidates: [(&str, &str, &str, &str); 3] = [
        (
            "Open MPI",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_LOCAL_RANK",
        ),
        ("PMI", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID"),
        ("PMIx", "PMIX_SIZE", "PMIX_RANK", "PMIX_LOCAL_RANK"),
    ];
    for (name, size, rank, local) in candidates {
        if let (Some(s), Some(r)) = (num(size), num(rank)) {
            return Some(Launch {
                size: s,
                rank: r,
                local_rank: num(local),
                launcher: format!("{name} ({size}={s})"),
            });
        }
    }
    // PMIx without a size variable: a launch, size unknown until MPI is initialised.
    num("PMIX_RANK").map(|r| Launch {
        size: 0,
        rank: r,
        local_rank: num("PMIX_LOCAL_RANK"),
        launcher: "PMIx (PMIX_RANK)".into(),
    })
}

impl Launch {
    /// True when the job has more than one rank (or an unknown count).
    pub fn is_parallel(&self) -> bool {
        self.size != 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn reads_open_mpi_and_pmi_variables() {
        let l = detect_from(env(&[
            ("OMPI_COMM_WORLD_SIZE", "3"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ]))
        .unwrap();
        assert_eq!((l.size, l.rank, l.local_rank), (3, 2, Some(0)));
        assert!(l.launcher.contains("Open MPI") && l.is_parallel());
        let l = detect_from(env(&[("PMI_SIZE", "1"), ("PMI_RANK", "0")])).unwrap();
        assert_eq!((l.size, l.rank, l.local_rank), (1, 0, None));
        assert!(!l.is_parallel());
        let l = detect_from(env(&[("PMIX_RANK", "1")])).unwrap();
        assert!(l.is_parallel() && l.rank == 1);
        assert!(detect_from(env(&[])).is_none());
        assert!(detect_from(env(&[
            ("OMPI_COMM_WORLD_SIZE", "x"),
            ("OMPI_COMM_WORLD_RANK", "0")
        ]))
        .is_none());
    }
}

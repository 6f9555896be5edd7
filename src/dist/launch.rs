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

/// The CPUs this process may run on against those its launcher may use. MPI launchers bind
/// ranks to cores (Open MPI binds each rank to one core when there are at most two), which a GPU
/// rank does not mind, but a CPU driver (lavapipe, llvmpipe) runs its worker threads on the
/// rank's CPUs only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuBinding {
    /// CPUs in this process's affinity mask.
    pub allowed: usize,
    /// CPUs in the parent process's affinity mask (the launcher's daemon), or online when that
    /// cannot be read. The parent, not the machine: a container may give both fewer CPUs than
    /// the machine has, and that is not the launcher's doing.
    pub launcher: usize,
}

impl CpuBinding {
    /// Reads both from Linux's `/proc` (`None` elsewhere, or if this process's mask cannot be
    /// read).
    pub fn of_this_process() -> Option<CpuBinding> {
        let allowed_of = |pid: &str| {
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()?
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .and_then(count_cpu_list)
        };
        let allowed = allowed_of("self")?;
        let launcher =
            allowed_of(&std::os::unix::process::parent_id().to_string()).or_else(|| {
                std::fs::read_to_string("/sys/devices/system/cpu/online")
                    .ok()
                    .as_deref()
                    .and_then(count_cpu_list)
            })?;
        Some(CpuBinding { allowed, launcher })
    }

    /// True when the launcher narrowed the CPUs this process may use.
    pub fn is_restricted(&self) -> bool {
        self.allowed < self.launcher
    }
}

/// The warning a rank prints when its launcher bound it to fewer CPUs than it may use while one
/// of its adapters (`cpu_adapter`) is a CPU driver, whose worker threads then run on the
/// rank's CPUs alone (measured 1.6x slower per stage on this project's 2-core machine,
/// docs/MULTINODE.md).
pub fn cpu_binding_warning(binding: CpuBinding, cpu_adapter: Option<&str>) -> Option<String> {
    let adapter = cpu_adapter?;
    binding.is_restricted().then(|| {
        format!(
            "this rank may run on {} of the {} CPUs its launcher may use (it bound the rank), and its \
             adapter '{adapter}' is a CPU driver whose threads share those CPUs; to let them \
             use every core, start the ranks with `mpirun --bind-to none` (Open MPI), and \
             calibrate with the same launch",
            binding.allowed, binding.launcher
        )
    })
}

/// Counts the CPUs of a Linux CPU list such as `0-3,8,10-11` (`None` if it is malformed).
pub fn count_cpu_list(text: &str) -> Option<usize> {
    let mut n = 0;
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (
                    a.trim().parse::<usize>().ok()?,
                    b.trim().parse::<usize>().ok()?,
                );
                b.checked_sub(a)? + 1
            }
            None => {
                part.trim().parse::<usize>().ok()?;
                1
            }
        };
    }
    (n > 0).then_some(n)
}

/// Writes one whole line to stderr in a single write. Ranks share their launcher's stderr:
/// `eprintln!` writes a line in pieces, so two ranks' lines could interleave mid-line.
pub fn stderr_line(line: &str) {
    use std::io::Write;
    let whole = format!("{line}\n");
    // Nothing useful is left to do if stderr itself is gone.
    let _ = std::io::stderr().lock().write_all(whole.as_bytes());
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

    #[test]
    fn counts_linux_cpu_lists() {
        assert_eq!(count_cpu_list("0-1\n"), Some(2));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list("0-3,8,10-11"), Some(7));
        assert_eq!(count_cpu_list(""), None);
        assert_eq!(count_cpu_list("3-1"), None);
        assert_eq!(count_cpu_list("a-b"), None);
        let b = CpuBinding {
            allowed: 1,
            launcher: 2,
        };
        assert!(b.is_restricted());
        if let Some(here) = CpuBinding::of_this_process() {
            assert!(here.allowed >= 1 && here.launcher >= 1);
        }
    }

    #[test]
    fn a_bound_rank_with_a_cpu_driver_is_warned() {
        let bound = CpuBinding {
            allowed: 1,
            launcher: 2,
        };
        let free = CpuBinding {
            allowed: 2,
            launcher: 2,
        };
        let w = cpu_binding_warning(bound, Some("llvmpipe")).unwrap();
        assert!(
            w.contains("1 of the 2 CPUs") && w.contains("--bind-to none"),
            "{w}"
        );
        assert!(w.contains("'llvmpipe'"), "{w}");
        assert_eq!(cpu_binding_warning(free, Some("llvmpipe")), None);
        // A GPU rank bound to a core is what launchers intend.
        assert_eq!(cpu_binding_warning(bound, None), None);
    }
}

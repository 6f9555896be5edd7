//! Fault arming over ranks (`--mpi-fault RANK:KIND[:AFTER]`): a rank told to fail with an
//! error or a panic after some micro-batches (a pipeline stage) or steps (tensor
//! parallelism), or to be killed (SIGKILL) or hung (SIGSTOP) after some milliseconds. For
//! tests and demonstrations of the failure path.

use crate::error::{Result, WgparError};
use crate::parallel::{Fault, FaultKind};

/// How a rank is told to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankFaultKind {
    /// Its job returns an error.
    Error,
    /// Its job panics.
    Panic,
    /// The process is killed (SIGKILL).
    Kill,
    /// The process is stopped (SIGSTOP): a hung rank.
    Hang,
}

/// A rank's fault: which rank, how, and after how many jobs (error, panic) or milliseconds
/// (kill, hang).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankFault {
    /// The rank that fails.
    pub rank: usize,
    /// How it fails.
    pub kind: RankFaultKind,
    /// Jobs (error, panic) or milliseconds (kill, hang) before it does.
    pub after: u64,
}

impl RankFault {
    /// Parses `RANK:KIND[:AFTER]`, e.g. `1:error` or `1:kill:500`.
    pub fn parse(text: &str) -> Result<Self> {
        let bad = || {
            WgparError::option(
                "--mpi-fault",
                format!(
                    "--mpi-fault {text}: expected RANK:KIND[:AFTER] with KIND error, panic, \
                     kill or hang, e.g. 1:error or 1:kill:500"
                ),
            )
        };
        let mut parts = text.split(':');
        let rank = parts.next().and_then(|r| r.parse().ok()).ok_or_else(bad)?;
        let kind = match parts.next() {
            Some("error") => RankFaultKind::Error,
            Some("panic") => RankFaultKind::Panic,
            Some("kill") => RankFaultKind::Kill,
            Some("hang") => RankFaultKind::Hang,
            _ => return Err(bad()),
        };
        let after = match parts.next() {
            Some(a) => a.parse().map_err(|_| bad())?,
            None => 0,
        };
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(Self { rank, kind, after })
    }

    /// Refuses a fault naming a rank the job of `size` ranks does not have.
    pub fn check(&self, size: usize) -> Result<()> {
        if self.rank >= size {
            return Err(WgparError::option(
                "--mpi-fault",
                format!("--mpi-fault names rank {} of a {size}-rank job", self.rank),
            ));
        }
        Ok(())
    }

    /// Whether it fails inside a job (an error or a panic), rather than by a signal.
    pub fn in_job(&self) -> bool {
        matches!(self.kind, RankFaultKind::Error | RankFaultKind::Panic)
    }

    /// The stage fault an error or panic injects (after that many micro-batches).
    pub fn stage_fault(&self) -> Fault {
        Fault {
            after: self.after as usize,
            kind: if self.kind == RankFaultKind::Panic {
                FaultKind::Panic
            } else {
                FaultKind::Error
            },
        }
    }

    /// Arms the fault on rank `rank`, if it names that rank: a kill or hang is a signal this
    /// process sends itself after `after` milliseconds (armed now); an error or panic is
    /// returned as the stage fault to inject. `(this rank's fault, its stage fault)`.
    pub fn arm(fault: Option<RankFault>, rank: usize) -> (Option<RankFault>, Option<Fault>) {
        let mine = fault.filter(|f| f.rank == rank);
        if let Some(f) = mine.filter(|f| !f.in_job()) {
            f.signal_self();
        }
        let stage = mine.filter(RankFault::in_job).map(|f| f.stage_fault());
        (mine, stage)
    }

    /// Sends this process SIGKILL (kill) or SIGSTOP (hang) after `after` milliseconds, from a
    /// thread of its own.
    fn signal_self(&self) {
        let signal = if self.kind == RankFaultKind::Kill {
            "-KILL"
        } else {
            "-STOP"
        };
        let (pid, after_ms) = (std::process::id().to_string(), self.after);
        let _ = std::thread::Builder::new()
            .name("mpi-fault".into())
            .spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(after_ms));
                let _ = std::process::Command::new("kill")
                    .args([signal, &pid])
                    .status();
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_faults_parse_and_arm_only_their_rank() {
        let f = RankFault::parse("1:panic:3").unwrap();
        assert_eq!(
            f,
            RankFault {
                rank: 1,
                kind: RankFaultKind::Panic,
                after: 3
            }
        );
        assert!(f.check(2).is_ok() && f.check(1).is_err());
        assert_eq!(f.stage_fault().kind, FaultKind::Panic);
        assert_eq!(f.stage_fault().after, 3);
        let (mine, stage) = RankFault::arm(Some(f), 0);
        assert!(mine.is_none() && stage.is_none(), "rank 0 is not named");
        let (mine, stage) = RankFault::arm(Some(f), 1);
        assert_eq!(mine, Some(f));
        assert_eq!(stage.map(|s| s.after), Some(3));
        for bad in ["", "x:error", "1:melt", "1:kill:soon", "1:kill:5:6"] {
            assert!(RankFault::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(RankFault::parse("0:hang").unwrap().after, 0);
    }
}

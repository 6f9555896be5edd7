//! Host profiles, engines, the link and compute cost model, and projection of timelines onto
//! profiles.
//!
//! Pure CPU code: nothing here touches a GPU. See `docs/PROJECTION.md` for the model.
//!
//! ```no_run
//! use wgpar::sim::{project, HostProfile, ProjectOptions};
//! use wgpar::trace::Timeline;
//! let timeline = Timeline::read_chrome_trace("run.json")?;
//! let profile = HostProfile::resolve("dgx-a100")?;
//! let projection = project(&timeline, &profile, &ProjectOptions::default())?;
//! println!("{}", projection.report);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod calibrated;
mod cost;
mod engine;
mod fit;
mod locate;
mod numformat;
mod pacing;
mod profile;
mod profile_error;
mod project;
mod project_error;
pub mod project_run;
pub mod projection_bench;
pub mod projection_run;
mod report;
mod rules;
mod shipped;

pub use calibrated::{
    calibrated_profile, calibrated_profile_toml, write_calibrated_profile, MachineMeasurement,
    MeasuredDevice,
};
pub use cost::{Algorithm, CostModel};
pub use engine::{CollectiveEntry, Engine, EngineCompute, LinkKind, Wire, SHIPPED_ENGINES};
pub use fit::{fit_alpha_beta, AlphaBetaFit, FitError};
pub use locate::{FieldPath, Seg};
pub use numformat::{NumFormat, NumFormatError};
pub use pacing::{pacer_for, Direction, LinkPacer, PaceSpec, PacingError};
pub use profile::{
    rate_at, rate_on_surface, rate_on_surface_at_width, ComputeSharing, DeviceSpec, HostLinkSpec,
    HostProfile, HostSpec, LinkSpec, NamedLink, Rates,
};
pub use profile_error::{Location, ProfileError};
pub use project::{
    project, project_engine, CollectivePolicy, HostGaps, ProjectOptions, Projection, StepBarriers,
};
pub use project_error::{ForwardDependency, ProjectError};
pub use project_run::merge_rank_traces;
pub use report::{KindTotal, ProjectionReport};
pub use shipped::SHIPPED_PROFILES;

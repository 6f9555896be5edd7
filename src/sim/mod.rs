//! Host profiles, the link and compute cost model, and projection of timelines onto profiles.
//!
//! Pure CPU code: nothing here touches a GPU. See `docs/PROJECTION.md` for the model.

mod calibrated;
mod fit;
mod locate;
mod profile;
mod profile_error;
mod shipped;

pub use calibrated::{
    calibrated_profile, calibrated_profile_toml, write_calibrated_profile, MachineMeasurement,
    MeasuredDevice,
};
pub use fit::{fit_alpha_beta, AlphaBetaFit, FitError};
pub use locate::{FieldPath, Seg};
pub use profile::{DeviceSpec, HostLinkSpec, HostProfile, HostSpec, LinkSpec, NamedLink, Rates};
pub use profile_error::{Location, ProfileError};
pub use shipped::SHIPPED_PROFILES;

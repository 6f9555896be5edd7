//! The profiles in `hosts/`, compiled into the binary so `wgpar project` works from anywhere.

use std::path::Path;

use super::profile::HostProfile;
use super::profile_error::ProfileError;

/// Name and TOML text of every shipped profile, in the order `wgpar` lists them.
pub const SHIPPED_PROFILES: &[(&str, &str)] = &[
    ("pcie3-2gpu", include_str!("../../hosts/pcie3-2gpu.toml")),
    ("pcie4-2gpu", include_str!("../../hosts/pcie4-2gpu.toml")),
    ("pcie4-4gpu", include_str!("../../hosts/pcie4-4gpu.toml")),
    (
        "pcie5-workstation",
        include_str!("../../hosts/pcie5-workstation.toml"),
    ),
    ("dgx-a100", include_str!("../../hosts/dgx-a100.toml")),
    ("dgx-h100", include_str!("../../hosts/dgx-h100.toml")),
    (
        "laptop-igpu-dgpu",
        include_str!("../../hosts/laptop-igpu-dgpu.toml"),
    ),
    (
        "apple-m-unified",
        include_str!("../../hosts/apple-m-unified.toml"),
    ),
    ("2node-ib200", include_str!("../../hosts/2node-ib200.toml")),
    (
        "2node-dgx-h100",
        include_str!("../../hosts/2node-dgx-h100.toml"),
    ),
];

impl HostProfile {
    /// A shipped profile by name (`"dgx-a100"`), parsed and validated.
    pub fn shipped(name: &str) -> Result<HostProfile, ProfileError> {
        match SHIPPED_PROFILES.iter().find(|(n, _)| *n == name) {
            Some((n, text)) => HostProfile::from_toml_str(text, &format!("hosts/{n}.toml")),
            None => Err(unknown(name)),
        }
    }

    /// A shipped profile when `name_or_path` is exactly its name (even with a file of that
    /// name in the working folder: write `./NAME` for the file), else a profile file if one
    /// exists there, else a shipped profile by the file's stem.
    pub fn resolve(name_or_path: &str) -> Result<HostProfile, ProfileError> {
        if SHIPPED_PROFILES.iter().any(|(n, _)| *n == name_or_path) {
            return HostProfile::shipped(name_or_path);
        }
        if Path::new(name_or_path).is_file() {
            return HostProfile::load(name_or_path);
        }
        let stem = name_or_path.strip_suffix(".toml").unwrap_or(name_or_path);
        let stem = stem.rsplit('/').next().unwrap_or(stem);
        if SHIPPED_PROFILES.iter().any(|(n, _)| *n == stem) {
            HostProfile::shipped(stem)
        } else {
            Err(unknown(name_or_path))
        }
    }
}

fn unknown(name: &str) -> ProfileError {
    ProfileError::Unknown {
        name: name.to_owned(),
        known: SHIPPED_PROFILES
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", "),
    }
}

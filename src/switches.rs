//! The environment switches wgpar reads, in one place, so a command can check all of them
//! before it opens a device or builds a weight ([`validate`]), and a misspelt value is refused
//! with the variable, the value and what it accepts instead of being read as "off".
//!
//! On/off switches ([`FLAGS`]) accept `1`, `true`, `yes`, `on` and `0`, `false`, `no`, `off`
//! or empty (any case). The tuning switches (`WGPAR_TUNE`, `WGPAR_KERNELS`,
//! `WGPAR_CACHE_DIR`) are parsed by [`crate::kernels::tune::TuneSettings::from_env`].

use crate::error::{Result, WgparError};

/// `WGPAR_FORCE_F32`: f32 weights even where the adapter has `SHADER_F16`.
pub const FORCE_F32: &str = "WGPAR_FORCE_F32";
/// `WGPAR_NO_SUBGROUPS`: never choose subgroup kernel variants.
pub const NO_SUBGROUPS: &str = "WGPAR_NO_SUBGROUPS";
/// `WGPAR_CHECKED_SHADERS`: compile shaders with wgpu's bounds checks and loop bounding.
pub const CHECKED_SHADERS: &str = "WGPAR_CHECKED_SHADERS";

/// Every on/off switch.
pub const FLAGS: [&str; 3] = [FORCE_F32, NO_SUBGROUPS, CHECKED_SHADERS];

/// `value` of switch `name` as on or off.
pub fn parse_flag(name: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "" | "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(WgparError::TuneSetting {
            name: name.into(),
            value: value.into(),
            expected: "1, true, yes or on; 0, false, no, off or empty".into(),
        }),
    }
}

/// Whether on/off switch `name` is on in the environment. A value [`parse_flag`] refuses
/// reads as off here; commands refuse it first, through [`validate`].
pub fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| parse_flag(name, &v).unwrap_or(false))
}

/// Checks every switch in the environment: the on/off switches and the tuning settings.
/// Commands call it before anything else, so a bad value costs milliseconds, not a device.
pub fn validate() -> Result<()> {
    for name in FLAGS {
        if let Some(value) = std::env::var_os(name) {
            parse_flag(name, &value.to_string_lossy())?;
        }
    }
    crate::kernels::tune::settings().map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_read_both_ways_and_refuse_the_rest() {
        for on in ["1", "true", "TRUE", "yes", "on", " 1 "] {
            assert!(parse_flag("X", on).unwrap(), "{on}");
        }
        for off in ["", "0", "false", "False", "no", "off"] {
            assert!(!parse_flag("X", off).unwrap(), "{off}");
        }
        for bad in ["maybe", "2", "enable", "1,0"] {
            let e = parse_flag("WGPAR_NO_SUBGROUPS", bad)
                .unwrap_err()
                .to_string();
            assert!(e.contains("WGPAR_NO_SUBGROUPS") && e.contains(bad), "{e}");
        }
    }
}

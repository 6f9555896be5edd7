//! `wgpar devices`.

use wgpar::device::Adapters;
use wgpar::error::human_bytes;
use wgpar::{Result, WgparError};

/// Prints every adapter as a table, or as JSON.
pub fn print(adapters: &Adapters, json: bool) -> Result<()> {
    if json {
        let text =
            serde_json::to_string_pretty(adapters.list()).map_err(|source| WgparError::Json {
                what: "the adapter list".into(),
                source,
            })?;
        outln!("{text}")?;
        return Ok(());
    }
    outln!(
        "{:>3}  {:<40} {:<7} {:<13} {:<8} {:>10} {:>12}  features",
        "idx",
        "name",
        "backend",
        "type",
        "vendor",
        "max buffer",
        "max storage"
    )?;
    for d in adapters.list() {
        let mut features = Vec::new();
        if d.shader_f16 {
            features.push("SHADER_F16".to_string());
        }
        if d.timestamp_query {
            features.push("TIMESTAMP_QUERY".to_string());
        }
        if d.subgroup {
            features.push(format!(
                "SUBGROUP({}-{})",
                d.subgroup_size.0, d.subgroup_size.1
            ));
        }
        let name: String = d.name.chars().take(40).collect();
        outln!(
            "{:>3}  {:<40} {:<7} {:<13} {:<#8x} {:>10} {:>12}  {}",
            d.index,
            name,
            d.backend,
            d.device_type,
            d.vendor,
            human_bytes(d.max_buffer_size),
            human_bytes(d.max_storage_binding),
            if features.is_empty() {
                "-".into()
            } else {
                features.join(" ")
            }
        )?;
        outln!("     driver: {} {}", d.driver, d.driver_info)?;
    }
    Ok(())
}

//! Property tests of every parser (issue 16 item 13): config.json, safetensors files and their
//! index, tokenizer.json, host profiles, traces and size suffixes. Random input and mutations
//! of valid input must only ever return `Ok` or an error: never panic, never abort.
//!
//! The regular test run keeps the case count modest; `PROPTEST_CASES=N` runs a longer campaign
//! (see docs/BENCHMARKS.md).

mod hf_support;

use std::path::Path;

use proptest::prelude::*;
use proptest::test_runner::Config;
use wgpar::comm::units::parse_size;
use wgpar::model::hf::{config, Checkpoint, TextTokenizer};
use wgpar::model::{ModelConfig, ModelWeights};
use wgpar::sim::HostProfile;
use wgpar::trace::Timeline;

/// Cases per property: modest by default, `PROPTEST_CASES` for a campaign.
fn cases(default: u32) -> Config {
    let n = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    Config {
        cases: n,
        failure_persistence: None,
        ..Config::default()
    }
}

/// A byte-level edit of a valid input.
#[derive(Debug, Clone)]
enum Mutation {
    Flip { at: usize, bits: u8 },
    Set { at: usize, byte: u8 },
    Truncate { at: usize },
    Delete { at: usize, len: usize },
    Insert { at: usize, bytes: Vec<u8> },
    Duplicate { at: usize, len: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let at = any::<usize>();
    prop_oneof![
        (at, 1u8..=255).prop_map(|(at, bits)| Mutation::Flip { at, bits }),
        (at, any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        at.prop_map(|at| Mutation::Truncate { at }),
        (at, 1usize..64).prop_map(|(at, len)| Mutation::Delete { at, len }),
        (at, proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        (at, 1usize..64).prop_map(|(at, len)| Mutation::Duplicate { at, len }),
    ]
}

/// Interesting replacements for JSON and TOML text: numbers at the edges, other types.
fn token() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "0",
        "-1",
        "1e300",
        "-1e-300",
        "18446744073709551616",
        "4294967296",
        "1.5",
        "null",
        "true",
        "\"x\"",
        "[]",
        "{}",
        "NaN",
        "inf",
        "\"\\u0000\"",
    ])
}

fn apply(mut data: Vec<u8>, edits: &[Mutation]) -> Vec<u8> {
    for m in edits {
        let n = data.len();
        let pos = |at: usize| if n == 0 { 0 } else { at % (n + 1) };
        match m {
            Mutation::Flip { at, bits } if n > 0 => data[at % n] ^= bits,
            Mutation::Set { at, byte } if n > 0 => data[at % n] = *byte,
            Mutation::Truncate { at } => data.truncate(pos(*at)),
            Mutation::Delete { at, len } => {
                let s = pos(*at);
                data.drain(s..(s + len).min(n));
            }
            Mutation::Insert { at, bytes } => {
                let s = pos(*at);
                data.splice(s..s, bytes.iter().copied());
            }
            Mutation::Duplicate { at, len } => {
                let s = pos(*at);
                let piece: Vec<u8> = data[s..(s + len).min(n)].to_vec();
                data.splice(s..s, piece);
            }
            _ => {}
        }
    }
    data
}

/// Replaces the `k`-th number or literal in `text` with `with`.
fn replace_value(text: &str, k: usize, with: &str) -> String {
    let bytes = text.as_bytes();
    let starts: Vec<usize> = (0..bytes.len())
        .filter(|&i| {
            let c = bytes[i];
            (c.is_ascii_digit() || c == b'-' || c == b't' || c == b'f' || c == b'n')
                && (i == 0 || matches!(bytes[i - 1], b':' | b' ' | b'[' | b',' | b'='))
        })
        .collect();
    if starts.is_empty() {
        return text.to_string();
    }
    let s = starts[k % starts.len()];
    let e = (s..bytes.len())
        .find(|&i| matches!(bytes[i], b',' | b'}' | b']' | b'\n'))
        .unwrap_or(bytes.len());
    format!("{}{}{}", &text[..s], with, &text[e..])
}

fn valid_configs() -> Vec<String> {
    ["tiny-llama", "tiny-gpt2", "tiny-bert"]
        .iter()
        .map(|p| {
            let w = ModelWeights::synthetic(&ModelConfig::preset(p).unwrap(), 1);
            hf_support::config_json(&w).to_string()
        })
        .collect()
}

proptest! {
    #![proptest_config(cases(64))]

    #[test]
    fn config_json_never_panics(
        which in 0usize..3,
        edits in proptest::collection::vec(mutation(), 0..4),
        k in any::<usize>(),
        with in token(),
        random in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let file = Path::new("m/config.json");
        let valid = &valid_configs()[which];
        let replaced = replace_value(valid, k, with);
        let _ = config::parse(file, &replaced, "m");
        let mutated = apply(replaced.into_bytes(), &edits);
        let _ = config::parse(file, &String::from_utf8_lossy(&mutated), "m");
        let _ = config::parse(file, &String::from_utf8_lossy(&random), "m");
    }

    #[test]
    fn size_suffixes_never_panic(text in "[0-9]{0,22}[ kKmMgGtTiIbB]{0,3}", random in ".{0,12}") {
        if let Ok(n) = parse_size(&text) {
            prop_assert!(n > 0 || text.trim_start_matches('0').chars().next().is_none_or(|c| !c.is_ascii_digit()));
        }
        let _ = parse_size(&random);
    }

    #[test]
    fn host_profiles_never_panic(
        which in 0usize..9,
        edits in proptest::collection::vec(mutation(), 0..4),
        k in any::<usize>(),
        with in token(),
    ) {
        let mut names: Vec<_> = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/hosts"))
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect();
        names.sort();
        let text = std::fs::read_to_string(&names[which % names.len()]).unwrap();
        let replaced = replace_value(&text, k, with);
        let _ = HostProfile::from_toml_str(&replaced, "p.toml");
        let mutated = apply(replaced.into_bytes(), &edits);
        let _ = HostProfile::from_toml_str(&String::from_utf8_lossy(&mutated), "p.toml");
    }

    #[test]
    fn traces_never_panic(
        edits in proptest::collection::vec(mutation(), 0..4),
        k in any::<usize>(),
        with in token(),
    ) {
        let text = sample_trace();
        let replaced = replace_value(&text, k, with);
        if let Ok(t) = Timeline::from_chrome_trace_str(&replaced, "t.json") {
            let _ = (t.summary(), t.steps());
        }
        let mutated = apply(replaced.into_bytes(), &edits);
        if let Ok(t) = Timeline::from_chrome_trace_str(&String::from_utf8_lossy(&mutated), "t.json") {
            let _ = (t.summary(), t.steps());
        }
    }
}

/// A small valid trace: a compute span, a hand-off and a collective on two devices.
fn sample_trace() -> String {
    use wgpar::trace::{CollectiveOp, SpanAttrs};
    let mut t = Timeline::new();
    let a = t.push_us(SpanAttrs::compute("layers 0..1", 0).flops(1000), 0.0, 10.0);
    let b = t.push_us(SpanAttrs::d2h("activations", 0, 64).after(a), 10.0, 2.0);
    let c = t.push_us(SpanAttrs::h2d("activations", 1, 64).after(b), 12.0, 2.0);
    t.push_us(
        SpanAttrs::collective(
            "allreduce",
            1,
            CollectiveOp::AllReduce,
            "host-staged",
            2,
            64,
        )
        .group(1)
        .after(c),
        14.0,
        3.0,
    );
    t.to_chrome_trace_string()
}

proptest! {
    // Each case writes files: fewer cases.
    #![proptest_config(cases(24))]

    #[test]
    fn safetensors_and_index_never_panic(
        edits in proptest::collection::vec(mutation(), 1..4),
        index_edits in proptest::collection::vec(mutation(), 0..3),
        header_only in any::<bool>(),
    ) {
        let w = ModelWeights::synthetic(&ModelConfig::preset("tiny-gpt2").unwrap(), 2);
        let dir = hf_support::write_checkpoint("prop-st", &w, hf_support::Store::F16);
        let file = dir.join("model.safetensors");
        let bytes = std::fs::read(&file).unwrap();
        // Mutate within the header (the first 8 + header bytes) or anywhere.
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let edits: Vec<Mutation> = if header_only {
            edits.into_iter().map(|m| match m {
                Mutation::Flip { at, bits } => Mutation::Flip { at: at % header, bits },
                Mutation::Set { at, byte } => Mutation::Set { at: at % header, byte },
                other => other,
            }).collect()
        } else {
            edits
        };
        std::fs::write(&file, apply(bytes.clone(), &edits)).unwrap();
        if let Ok(c) = Checkpoint::open(&dir) {
            let _ = c.weights(false);
        }
        // The same tensors as one shard named by an index, the index mutated.
        std::fs::rename(&file, dir.join("model-00001-of-00001.safetensors")).unwrap();
        let index = serde_json::json!({
            "metadata": {"total_size": bytes.len()},
            "weight_map": hf_support::tensors(&w)
                .iter()
                .map(|(n, _, _)| (n.clone(), serde_json::json!("model-00001-of-00001.safetensors")))
                .collect::<serde_json::Map<_, _>>()
        })
        .to_string();
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            apply(index.into_bytes(), &index_edits),
        )
        .unwrap();
        if let Ok(c) = Checkpoint::open(&dir) {
            let _ = c.weights(false);
        }
    }

    #[test]
    fn tokenizer_json_never_panics(
        edits in proptest::collection::vec(mutation(), 0..4),
        k in any::<usize>(),
        with in token(),
        text in ".{0,40}",
    ) {
        let dir = hf_support::scratch("prop-tok");
        hf_support::write_word_tokenizer(&dir, 50);
        let file = dir.join("tokenizer.json");
        let valid = std::fs::read_to_string(&file).unwrap();
        let replaced = replace_value(&valid, k, with);
        std::fs::write(&file, apply(replaced.into_bytes(), &edits)).unwrap();
        if let Ok(t) = TextTokenizer::from_file(&file, Some(8)) {
            if let Ok(ids) = t.encode(&text) {
                let _ = t.decode(&ids);
            }
            let _ = t.encode_for_encoder(&text);
        }
    }
}

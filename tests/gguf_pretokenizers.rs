//! Every `tokenizer.ggml.pre` value wgpar rebuilds gives the ids of Hugging Face's `tokenizers`
//! library. `gguf_support/pretokenizers.py` learns one byte-level vocabulary (merges across
//! spaces, digits, punctuation and newlines), writes it into a GGUF file per value, and encodes
//! a corpus (numbers, contractions, punctuation runs, CJK, emoji, whitespace runs, code) with a
//! `tokenizers.Tokenizer` built from the same vocabulary and merges and the family's rules as
//! written on the Python side. wgpar reads each file's metadata and must give the same ids.

mod common;

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;
use wgpar::error::WgparError;
use wgpar::model::gguf::tokenizer::{self, PRE_RULES};
use wgpar::model::gguf::GgufFile;

/// Runs the reference script (extra arguments after the output folder) and reads its cases.
fn reference(dir: &Path, extra: &[&str]) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gguf_support/pretokenizers.py");
    let out = std::process::Command::new(common::python())
        .arg(script)
        .arg(dir)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pretokenizers.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap()
}

/// Encodes the corpus with each case's file and compares with the reference; returns the
/// number of ids compared.
fn compare_cases(reference: &Value) -> usize {
    let texts: Vec<&str> = (reference["texts"].as_array().unwrap().iter())
        .map(|t| t.as_str().unwrap())
        .collect();
    let mut compared = 0;
    for case in reference["cases"].as_array().unwrap() {
        let file = GgufFile::open(Path::new(case["file"].as_str().unwrap())).unwrap();
        let what = format!("pre {} with {}", case["pre"], case["flags"]);
        let tok = tokenizer::load(&file).unwrap_or_else(|e| panic!("{what}: {e}"));
        for (i, text) in texts.iter().enumerate() {
            let want: Vec<u32> = serde_json::from_value(case["ids"][i].clone()).unwrap();
            let mut got = vec![u32::MAX; 1];
            assert_ne!(got, want);
            got = tok.encode(text).unwrap();
            assert_eq!(got, want, "{what}: ids of {text:?}");
            assert_eq!(
                tok.decode(&got).unwrap(),
                case["text"][i].as_str().unwrap(),
                "{what}: text of {text:?}"
            );
            compared += want.len();
        }
    }
    compared
}

#[test]
fn every_pre_tokenizer_gives_the_tokenizers_library_ids() {
    let dir = common::scratch_dir("gguf-pretok");
    let reference = reference(&dir, &[]);
    let compared = compare_cases(&reference);
    let cases = reference["cases"].as_array().unwrap();
    assert!(compared > 100 * cases.len(), "compared {compared} ids");
    // Every value wgpar rebuilds has a case of its own, and every case one value's rules.
    let tested: BTreeSet<&str> = cases.iter().filter_map(|c| c["pre"].as_str()).collect();
    let rebuilt: BTreeSet<&str> = PRE_RULES
        .iter()
        .flat_map(|r| r.names.iter().copied())
        .collect();
    assert_eq!(tested, rebuilt);
    // The flags of the file: a BOS the family does not add by default, an EOS, a space prefix.
    let flags: Vec<&Value> = cases.iter().map(|c| &c["flags"]).collect();
    for key in ["add_bos", "add_eos", "add_space_prefix"] {
        assert!(
            flags.iter().any(|f| f.get(key).is_some()),
            "no case sets {key}"
        );
    }
}

#[test]
fn a_pre_tokenizer_wgpar_does_not_rebuild_is_refused_by_name() {
    let dir = common::scratch_dir("gguf-pretok-refused");
    let reference = reference(&dir, &[]);
    let refused = reference["refused"].as_object().unwrap();
    assert!(refused.len() >= 2);
    for (pre, file) in refused {
        let file = GgufFile::open(Path::new(file.as_str().unwrap())).unwrap();
        let err = tokenizer::load(&file).unwrap_err();
        let text = err.to_string();
        match err {
            WgparError::UnknownPreTokenizer { pre: named, .. } => assert_eq!(&named, pre),
            other => panic!("{pre}: {other}"),
        }
        assert!(text.contains(&format!("'{pre}'")), "{text}");
        assert!(text.contains("--tokenizer"), "{text}");
    }
}

/// The released SmolLM2-135M-Instruct GGUF (`smollm`): its own 49152-token vocabulary and merges
/// give wgpar the ids the `tokenizers` library gives with StarCoder's rules.
#[test]
fn smollm2_file_gives_the_tokenizers_library_ids() {
    let file = common::smollm2_gguf();
    let dir = common::scratch_dir("gguf-pretok-smollm2");
    let reference = reference(&dir, &["--gguf", file.to_str().unwrap()]);
    assert_eq!(reference["cases"][0]["pre"], "smollm");
    let compared = compare_cases(&reference);
    assert!(compared > 200, "compared {compared} ids");
}

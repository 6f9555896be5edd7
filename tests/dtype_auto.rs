//! `--dtype auto` (issue 38 item 4, the default): a checkpoint stored in f16 or bf16 stays in
//! f16 where every selected adapter has SHADER_F16, and falls back to f32 with a note; f32
//! checkpoints and presets stay f32; `--dtype f32|f16` still force a precision.

mod common;
mod gguf_support;
mod hf_support;

use gguf_support::{gguf_tensors, model_meta, whole_block_llama, write_gguf, GgufSpec};
use hf_support::{write_checkpoint, Store};
use wgpar::model::hf::Checkpoint;
use wgpar::model::quant::QuantType;
use wgpar::model::{ModelConfig, ModelWeights};

const KEPT: &str = "weights held in f16, as the checkpoint stores them";
const WIDENED: &str = "the checkpoint stores f16/bf16 weights; they are held in f32 because";

#[test]
fn a_checkpoint_stores_half_when_its_matrices_are_f16_or_bf16() {
    let w = ModelWeights::synthetic(&ModelConfig::preset("tiny-llama").unwrap(), 7);
    let mut checked = 0;
    for (store, want) in [(Store::F16, true), (Store::Bf16, true), (Store::F32, false)] {
        let dir = write_checkpoint("dtype-auto-folder", &w, store);
        let got = Checkpoint::open(&dir).unwrap().stores_half();
        assert_eq!(got, want, "{store:?}");
        checked += 1;
    }
    // A GGUF keeps its 1-D tensors in F32 (as llama.cpp writes them): the matrices decide;
    // block types count as neither.
    let w = ModelWeights::synthetic(&whole_block_llama(), 7);
    for (matrices, want) in [
        (QuantType::F16, true),
        (QuantType::F32, false),
        (QuantType::Q8_0, false),
    ] {
        let dir = hf_support::scratch("dtype-auto-gguf");
        let spec = GgufSpec {
            arch: "llama",
            matrices,
            meta: model_meta(&w, "llama"),
        };
        let path = write_gguf(&dir, "m", &gguf_tensors(&w, true), &spec);
        let got = Checkpoint::open(&path).unwrap().stores_half();
        assert_eq!(got, want, "{matrices:?}");
        checked += 1;
    }
    assert_eq!(checked, 6);
}

fn run(dir: &std::path::Path, extra: &[&str]) -> String {
    let mut args = vec!["run", "--model", dir.to_str().unwrap()];
    args.extend(["--batch", "1", "--prompt-len", "4", "--gen", "2"]);
    args.extend(extra);
    let (ok, out, err) = common::wgpar(&args);
    assert!(ok && out.contains("decode:"), "{args:?}: {err}");
    err
}

#[test]
fn run_keeps_an_f16_checkpoint_in_f16_where_the_adapter_can_and_says_so() {
    let w = ModelWeights::synthetic(&ModelConfig::preset("tiny-llama").unwrap(), 9);
    let half = write_checkpoint("dtype-auto-run-f16", &w, Store::F16);
    let shader_f16 = common::gpus(1)[0].info().shader_f16;
    let err = run(&half, &[]);
    if shader_f16 {
        assert!(err.contains(KEPT) && !err.contains(WIDENED), "{err}");
    } else {
        assert!(
            err.contains(WIDENED) && err.contains("lacks SHADER_F16"),
            "{err}"
        );
    }
    let err = run(&half, &["--force-f32"]);
    assert!(
        err.contains(WIDENED) && err.contains("--force-f32"),
        "{err}"
    );
    // Forced precisions and f32 checkpoints get no note.
    let err = run(&half, &["--dtype", "f32"]);
    assert!(!err.contains(KEPT) && !err.contains(WIDENED), "{err}");
    let full = write_checkpoint("dtype-auto-run-f32", &w, Store::F32);
    let err = run(&full, &[]);
    assert!(!err.contains(KEPT) && !err.contains(WIDENED), "{err}");
}

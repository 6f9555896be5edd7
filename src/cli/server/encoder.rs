//! `serve --model` an encoder's folder: `/v1/embeddings` on one device.

use wgpar::device::Adapters;
use wgpar::parallel::{Encoder, SingleEncoder};
use wgpar::server::EncoderBuilder;
use wgpar::{Result, WgparError};

use super::{Prepared, ServerArgs};

/// `serve --model` an encoder's folder: `/v1/embeddings` on one device (the options of
/// generation that do not apply are refused by name, before any device opens).
pub(super) fn serve(args: &ServerArgs, prepared: Prepared) -> Result<()> {
    let Prepared { config, text, opts } = prepared;
    refuse_for_encoder(args, &config.name)?;
    let adapters = Adapters::discover()?;
    let (devices, model) = (args.devices.choice(), args.model.clone());
    let dim = config.hidden;
    let build: EncoderBuilder = Box::new(move || {
        let weights = model.choice().weights(&config)?;
        let gpus = devices.open(&adapters)?;
        let dtype = model.choice().dtype(&gpus)?;
        let encoder = SingleEncoder::new(gpus[0].clone(), &weights, dtype)?;
        Ok(Box::new(encoder) as Box<dyn Encoder>)
    });
    wgpar::server::run_encoder(opts, text, dim, build)
}

/// Refuses, by name, every option of `serve` that an encoder's server has no use for: it
/// encodes on one device with no strategy, no memory plan (`--gpu-memory` is checked
/// against a decoder's accounting), no prefill steps (`--max-batch` bounds its batches),
/// no sampling and no chat. Each is refused when given at all, default value or not (`--seed`
/// is `None` unless given).
fn refuse_for_encoder(args: &ServerArgs, model: &str) -> Result<()> {
    let refuse = |option: &str, given: bool| match given {
        true => Err(WgparError::unsupported(format!(
            "{option} does not apply to an encoder's server (model '{model}' serves \
             /v1/embeddings)"
        ))),
        false => Ok(()),
    };
    refuse("more than one device", args.devices.choice().count() > 1)?;
    refuse(
        "--strategy",
        !matches!(args.strategy.strategy.as_str(), "none" | "single"),
    )?;
    // --tp, --split, --layers, --partition, --micro-batches, --schedule: none applies to a
    // single device, which is what the strategy check refuses them for.
    args.strategy.choice().check_options()?;
    refuse("--gpu-memory", args.memory.gpu_memory.is_some())?;
    refuse("--max-prefill-tokens", args.max_prefill_tokens.is_some())?;
    refuse("--max-step-tokens", args.max_step_tokens.is_some())?;
    refuse("--no-prefix-cache", args.no_prefix_cache)?;
    // The seed only makes a preset's synthetic weights; a folder's weights are its own.
    let synthetic = matches!(args.model.model, wgpar::model::hub::ModelRef::Preset(_));
    refuse("--seed", args.model.seed.is_some() && !synthetic)?;
    refuse("--chat-template", args.chat_template.is_some())?;
    refuse("--pace", args.pace.is_some())?;
    refuse("--inject-fault", args.inject_fault.is_some())
}

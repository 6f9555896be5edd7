//! The library's error type. Every variant carries the numbers a user needs to act on it.

use thiserror::Error;

/// Everything that can go wrong in wgpar, from adapter discovery to a failed collective.
#[derive(Debug, Error)]
pub enum WgparError {
    /// No wgpu adapter exists on this machine.
    #[error(
        "no GPU adapter found on backends {backends}. On a GPU-less Linux install a software \
         Vulkan driver: `apt-get install mesa-vulkan-drivers` (Mesa lavapipe); elsewhere install \
         your GPU's Vulkan, Metal or DX12 driver"
    )]
    NoAdapter {
        /// The backends that were searched.
        backends: String,
    },
    /// A device index outside the discovered adapters.
    #[error("device index {index} does not exist: {count} adapter(s) found (run `wgpar devices`)")]
    AdapterIndex {
        /// The index asked for.
        index: usize,
        /// How many adapters exist.
        count: usize,
    },
    /// The driver refused to create a device.
    #[error("could not open a device on adapter '{adapter}': {message}")]
    RequestDevice {
        /// Adapter name.
        adapter: String,
        /// The driver's message.
        message: String,
    },
    /// A wgpu validation, out-of-memory or internal error caught by the uncaptured-error handler.
    #[error("GPU error on {device}: {message}")]
    Gpu {
        /// Device label.
        device: String,
        /// wgpu's description.
        message: String,
    },
    /// The device was lost (driver reset, removal, destruction).
    #[error("device {device} was lost: {reason}")]
    DeviceLost {
        /// Device label.
        device: String,
        /// Why, as the driver reported it.
        reason: String,
    },
    /// A buffer larger than the adapter allows.
    #[error(
        "{what} needs {} ({bytes} B) but adapter '{adapter}' allows at most {} ({limit} B) per {kind}",
        human_bytes(*bytes),
        human_bytes(*limit)
    )]
    TooLarge {
        /// What was being allocated.
        what: String,
        /// Bytes needed.
        bytes: u64,
        /// The adapter's limit.
        limit: u64,
        /// "buffer" or "storage binding".
        kind: &'static str,
        /// Adapter name.
        adapter: String,
    },
    /// Tensors whose shapes or lengths do not fit together.
    #[error("shape mismatch in {op}: {detail}")]
    Shape {
        /// The operation.
        op: String,
        /// What did not fit.
        detail: String,
    },
    /// An environment switch (`WGPAR_*`) or a tuning flag has a value wgpar does not know.
    #[error("{name}={value} is not valid: expected {expected}")]
    TuneSetting {
        /// The switch (environment variable or flag).
        name: String,
        /// The value given.
        value: String,
        /// What it accepts.
        expected: String,
    },
    /// The kernel-tuning cache could not be written.
    #[error("tuning cache {path}: {source}")]
    TuneCache {
        /// File or folder.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// An invalid configuration with no more specific variant below (a free-text remainder;
    /// new code uses the typed variants).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An option (a flag, or the library parameter behind one) whose value wgpar refuses:
    /// the user changes that option. `detail` names it and says what it accepts.
    #[error("{detail}")]
    InvalidOption {
        /// The option, e.g. `--max-seq` (or the parameter's name for a library call).
        option: String,
        /// What is wrong and what would be accepted.
        detail: String,
    },
    /// A model configuration or checkpoint field wgpar cannot use: the model, not an option,
    /// has to change.
    #[error("{detail}")]
    InvalidModel {
        /// The model's name or file.
        model: String,
        /// The field, e.g. `heads` or a tensor's name.
        field: String,
        /// What is wrong, with the numbers.
        detail: String,
    },
    /// Options, model and devices that each make sense but not together (e.g. a strategy that
    /// does not split this model, a feature the selected adapter lacks).
    #[error("{detail}")]
    Unsupported {
        /// What does not go together, and what would.
        detail: String,
    },
    /// More of a resource than there is: memory, context, rows of a dispatch.
    #[error("{detail}")]
    ResourceLimit {
        /// What ran out, e.g. `context (tokens)` or `host memory (bytes)`.
        resource: String,
        /// How much was needed.
        needed: u64,
        /// How much there is.
        available: u64,
        /// The message, with both numbers and a way out.
        detail: String,
    },
    /// A failure while running (not something an option changes), with its cause kept.
    #[error("{what}: {source}")]
    Runtime {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// `--model` names neither a preset nor a model folder.
    #[error(
        "no model preset or folder named '{name}': presets are {presets}; or pass a Hugging \
         Face model folder (config.json, *.safetensors, tokenizer.json)"
    )]
    UnknownModel {
        /// What was given.
        name: String,
        /// The presets, comma-separated.
        presets: String,
    },
    /// `--model` names nothing on this machine (model::hub).
    #[error(transparent)]
    Hub(#[from] crate::model::hub::HubError),
    /// A host profile that cannot be read, parsed or used. (Boxed: errors stay small.)
    #[error(transparent)]
    Profile(Box<crate::sim::ProfileError>),
    /// A timeline or trace file that cannot be read, written or checked.
    #[error(transparent)]
    Trace(#[from] crate::trace::TraceError),
    /// A link pacer that cannot be built or cannot model a call.
    #[error("pacing to {target}: {source}")]
    Pacing {
        /// What was paced to: `--pace`'s value or a profile name.
        target: String,
        /// The pacer's error.
        #[source]
        source: crate::sim::PacingError,
    },
    /// A timeline that cannot be projected onto a host profile.
    #[error("projecting {what} onto profile '{profile}': {source}")]
    Projection {
        /// What was projected (a run, a plan row, ...).
        what: String,
        /// The profile.
        profile: String,
        /// The projection's error.
        #[source]
        source: crate::sim::ProjectError,
    },
    /// A measured sweep that cannot be fitted to a latency-bandwidth line.
    #[error(
        "cannot fit the {what} sweep: {source}; measure again on a quieter machine or over a \
         wider size range"
    )]
    Fit {
        /// Which sweep.
        what: String,
        /// The fit's error.
        #[source]
        source: crate::sim::FitError,
    },
    /// A collective or transfer failed at run time (a rank aborted, left or timed out).
    #[error(transparent)]
    Comm(crate::comm::CommError),
    /// A pipeline stage or tensor-parallel rank failed; its cause is kept.
    #[error("{worker} failed: {source}")]
    WorkerFailed {
        /// Which worker, e.g. "stage 1 (gpu1 ...)" or "tp rank 1 (...)".
        worker: String,
        /// What went wrong there.
        #[source]
        source: Box<WgparError>,
    },
    /// A worker thread panicked: a bug in wgpar, or an injected panic.
    #[error(
        "{worker} panicked: {message}; the run was stopped and every thread joined (unless \
         injected, please report this with the command that caused it)"
    )]
    WorkerPanicked {
        /// Which worker.
        worker: String,
        /// The panic's message.
        message: String,
    },
    /// A worker, or the caller it answers, stopped before the exchange completed.
    #[error("{worker} has stopped: {detail}")]
    WorkerStopped {
        /// Which worker (or "the caller").
        worker: String,
        /// What was being done when it was found gone.
        detail: String,
    },
    /// An engine refuses further steps after a failure; the first failure is named.
    #[error(
        "{engine} stopped after an earlier failure ({cause}); build a new engine (reopen the \
         devices) to continue"
    )]
    EngineStopped {
        /// Which engine.
        engine: String,
        /// The first failure's message.
        cause: String,
    },
    /// No output arrived in time.
    #[error(
        "{engine}: no output within {secs:.1} s; a device may be hung (check `wgpar devices`), \
         or the timeout is too short for this model on this adapter"
    )]
    Timeout {
        /// Which engine.
        engine: String,
        /// The limit that passed.
        secs: f64,
    },
    /// A fault injected on purpose (`--inject-fault`, `inject_fault`): the failure path works.
    #[error("injected {kind} fault at {at}")]
    InjectedFault {
        /// error, panic or device-lost.
        kind: String,
        /// Where and when, e.g. "stage 1, step 3".
        at: String,
    },
    /// A library function called out of order or with arguments that do not fit its state,
    /// with no more specific variant below.
    #[error("invalid call: {0}")]
    InvalidCall(String),
    /// A library call given a list whose length does not match what it describes (one entry
    /// per stage, per device): pass one per item.
    #[error("invalid call: {what}: {got} given for {expected}")]
    LengthMismatch {
        /// What the list holds, and per what.
        what: String,
        /// Entries given.
        got: usize,
        /// Entries expected.
        expected: usize,
    },
    /// A library call given fewer of something than it needs (devices, timed steps).
    #[error("invalid call: {what}: {got} given, at least {min} needed")]
    TooFew {
        /// What was counted.
        what: String,
        /// How many were given.
        got: usize,
        /// The least that works.
        min: usize,
    },
    /// A strategy passed to a call that builds another kind (a single-device or tensor-parallel
    /// strategy where a pipeline is built).
    #[error("invalid call: {strategy} is not a {expected} strategy")]
    WrongStrategy {
        /// The strategy given.
        strategy: String,
        /// The kind the call builds.
        expected: String,
    },
    /// Device sampling settings out of their ranges.
    #[error(
        "invalid call: device sampling needs top-k in 1..={max_top_k}, a finite temperature > 0 \
         and top-p in (0, 1]; got top-k {top_k}, temperature {temperature}, top-p {top_p}"
    )]
    SamplingRange {
        /// Candidates asked for.
        top_k: usize,
        /// The most the kernel keeps.
        max_top_k: usize,
        /// Softmax temperature given.
        temperature: f32,
        /// Nucleus mass given.
        top_p: f32,
    },
    /// A stage cost for the balanced partition that is not a positive time (a failed or
    /// invented measurement).
    #[error("invalid call: stage costs must be positive: stage {stage} has {what} {seconds} s")]
    StageCost {
        /// The stage.
        stage: usize,
        /// Which cost: `layer`, `embedding` or `head`.
        what: String,
        /// The value given, seconds.
        seconds: f64,
    },
    /// A step's copy of cached KV between slots that does not fit the reserved cache (a slot
    /// out of range, a slot copied onto itself, more positions than a slot holds).
    #[error(
        "invalid call: KV copy of {tokens} positions from slot {from} to slot {to}: {why} \
         ({slots} slots of {max_seq} positions reserved)"
    )]
    KvCopy {
        /// Slot copied from.
        from: usize,
        /// Slot copied into.
        to: usize,
        /// Positions copied.
        tokens: usize,
        /// Slots reserved.
        slots: usize,
        /// Positions per slot.
        max_seq: usize,
        /// Which bound it breaks.
        why: &'static str,
    },
    /// A step's block table of a slot that does not fit the reserved cache (a slot or block
    /// out of range, a short block out of place).
    #[error(
        "invalid call: KV block table of slot {slot}: {why} ({slots} slots of {max_seq} \
         positions reserved)"
    )]
    KvTable {
        /// The slot whose table it is.
        slot: usize,
        /// Slots reserved.
        slots: usize,
        /// Positions per slot.
        max_seq: usize,
        /// Which bound it breaks, with its numbers.
        why: String,
    },
    /// A decode step asked of an engine that holds no prefilled batch.
    #[error("invalid call: decode before prefill: prefill a batch first")]
    DecodeBeforePrefill,
    /// A decode step whose tokens do not match the prefilled batch (one token per sequence).
    #[error(
        "invalid call: a decode step got {got} tokens for the {batch} sequences of the \
         prefilled batch: give one token per sequence"
    )]
    DecodeTokens {
        /// Tokens given.
        got: usize,
        /// Sequences in the batch.
        batch: usize,
    },
    /// A batch of prompts with no prompt, or an empty one.
    #[error("invalid call: need at least one non-empty prompt")]
    NoPrompt,
    /// A batch of prompts of different lengths (a step runs prompts of one length).
    #[error(
        "invalid call: prompts must have equal lengths: {first} vs {other} tokens; pad them or \
         run them as separate batches (or serve them: continuous batching takes any lengths)"
    )]
    UnequalPrompts {
        /// The first prompt's length.
        first: usize,
        /// The length of the first prompt that differs.
        other: usize,
    },
    /// Two strategies (or two configurations) that must agree on a run's result did not: a
    /// generated token or the prefill's logits differ. A bug in wgpar or in a driver.
    #[error(
        "{strategy} disagrees with {reference}: {detail}; please report it with the command \
         and `wgpar devices`"
    )]
    Disagreement {
        /// The strategy (or configuration) checked.
        strategy: String,
        /// What it was checked against.
        reference: String,
        /// What differs, with the values.
        detail: String,
    },
    /// A measurement produced nothing to summarise (no sample, no timed repetition).
    #[error("measurement failed: {0}; run it again with more repetitions")]
    Measurement(String),
    /// A report could not be serialised.
    #[error("cannot write {what} as JSON: {source}")]
    Json {
        /// What was being written.
        what: String,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },
    /// A chart could not be drawn.
    #[error("cannot draw chart {path}: {message}")]
    Chart {
        /// The SVG file.
        path: String,
        /// The drawing backend's message.
        message: String,
    },
    /// A child process (another `wgpar` run) failed.
    #[error("{command}: {detail}")]
    Subprocess {
        /// The command line.
        command: String,
        /// How it failed, with its exit status or error.
        detail: String,
    },
    /// An internal invariant broke: a bug in wgpar.
    #[error("internal error: {0}; please report it with the command that caused it")]
    Internal(String),
    /// A buffer could not be mapped for reading or writing.
    #[error("buffer mapping failed on {device}: {message}")]
    Map {
        /// Device label.
        device: String,
        /// wgpu's description.
        message: String,
    },
    /// A worker thread (pipeline stage, tensor-parallel rank) could not be started, or failed
    /// in a way that has no typed cause.
    #[error("{worker} failed: {message}")]
    Worker {
        /// Which worker, e.g. "stage 1 (gpu1)".
        worker: String,
        /// The cause.
        message: String,
    },
    /// A GGUF file's tokenizer names a pre-tokenizer (`tokenizer.ggml.pre`) wgpar does not
    /// rebuild from the metadata: the model's own `tokenizer.json` (`--tokenizer`) still works.
    #[error(
        "{file}: tokenizer.ggml.pre is '{pre}': {reason}; pass --tokenizer \
         path/to/tokenizer.json (the model's Hugging Face tokenizer) to use this model"
    )]
    UnknownPreTokenizer {
        /// The GGUF file.
        file: String,
        /// The value of `tokenizer.ggml.pre`.
        pre: String,
        /// Why it is not rebuilt (unknown, or not a regex pre-tokenizer).
        reason: String,
    },
    /// A Hugging Face checkpoint that cannot be used: a missing or malformed file, a missing
    /// tensor, a tensor of the wrong shape or dtype, an unsupported architecture.
    #[error("{file}{}: {detail}", tensor.as_ref().map(|t| format!(": tensor '{t}'")).unwrap_or_default())]
    Checkpoint {
        /// The file at fault (config.json, a safetensors file, tokenizer.json, ...).
        file: String,
        /// The tensor at fault, where one is.
        tensor: Option<String>,
        /// What is wrong, with the numbers found and expected.
        detail: String,
    },
    /// A GGUF tensor in a ggml type no kernel of wgpar reads (IQ1-IQ3, TQ, ...): refused when
    /// the file is opened, before any device allocation.
    #[error(
        "{file}: tensor '{tensor}' is {ggml_type}, which wgpar has no kernel for (it reads F32, \
         F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and \
         IQ4_XS): re-quantize the file with llama.cpp, e.g. `llama-quantize --allow-requantize \
         IN.gguf OUT.gguf Q4_K_M`"
    )]
    TensorType {
        /// The GGUF file.
        file: String,
        /// The tensor's name.
        tensor: String,
        /// ggml's name of its type.
        ggml_type: String,
    },
    /// A step produced NaN or infinite logits: no token is emitted from them.
    #[error(
        "non-finite logits (NaN or infinity) at step {step} for sequence(s) {rows:?}{}: no \
         token was emitted. Check the weights for NaN/inf and the config (norm eps, rope theta)",
        location.as_ref().map(|l| format!(", first seen after {l}")).unwrap_or_default()
    )]
    NonFinite {
        /// The step: 0 is the prefill, k the k-th decode step.
        step: usize,
        /// Sequences (rows of the batch) whose logits were not finite.
        rows: Vec<usize>,
        /// Where the values first turned non-finite, where it was cheap to find out (e.g.
        /// "layer 3" on a single device).
        location: Option<String>,
    },
    /// Running as MPI ranks (`dist`): a failed or silent peer, a layout the ranks cannot run.
    #[error(transparent)]
    Dist(#[from] crate::dist::DistError),
    /// Rank traces of an MPI run that do not merge into one timeline.
    #[error("merging rank traces: {0}")]
    Merge(#[from] crate::trace::MergeError),
    /// A served request needs more KV cache than a slot holds.
    #[error(
        "request {request} needs {needed} tokens of KV cache ({prompt} prompt + {generated} generated - 1), \
         but a slot holds {capacity} (max_seq of model '{model}'): shorten its prompt or output"
    )]
    KvCapacity {
        /// Request index.
        request: usize,
        /// Tokens it would cache.
        needed: usize,
        /// Prompt tokens.
        prompt: usize,
        /// Tokens to generate.
        generated: usize,
        /// Tokens a slot holds.
        capacity: usize,
        /// Model name.
        model: String,
    },
    /// A served request that cannot run at all (no prompt, nothing to generate, bad token).
    #[error("request {request}: {reason}")]
    BadRequest {
        /// Request index.
        request: usize,
        /// What is wrong.
        reason: String,
    },
    /// Standard output cannot be written: the reader closed the pipe, or the disk is full.
    #[error("cannot write to standard output: {source}")]
    Stdout {
        /// The write's error.
        source: std::io::Error,
    },
    /// File input/output.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A token id or token type outside what the model has (ids below its vocabulary, types
    /// below its type vocabulary): the caller tokenized for another model.
    #[error("invalid call: sequence {sequence}: {what} {value} is outside the {range} of {limit}")]
    TokenRange {
        /// The sequence (row of the batch).
        sequence: usize,
        /// `token id` or `token type`.
        what: &'static str,
        /// The value given.
        value: u32,
        /// `vocabulary` or `type vocabulary`.
        range: &'static str,
        /// How many the model has.
        limit: usize,
    },
    /// A call for one kind of model given the other: an encoder's pooled embedding asked of a
    /// decoder, or a decoder's logits of an encoder.
    #[error("invalid call: {call} needs {needs}, and model '{model}' is not one")]
    WrongModelKind {
        /// The model given.
        model: String,
        /// What was asked, e.g. `a pooled embedding`.
        call: String,
        /// The kind it needs, e.g. `an encoder (BERT-style)`.
        needs: &'static str,
    },
    /// Structured output (a grammar-constrained answer) that cannot go on: the model's
    /// tokenizer cannot drive a grammar (`after` is `None`), or the grammar engine failed or
    /// left no token to continue after `after` tokens of the answer.
    #[error(
        "structured output {}: {detail}",
        after.map_or("needs the model's tokens as bytes".to_string(), |n| format!("failed after {n} tokens"))
    )]
    Grammar {
        /// Tokens of the answer fed to the grammar before it failed; `None` when it never
        /// started.
        after: Option<usize>,
        /// The tokenizer's or grammar engine's account.
        detail: String,
    },
    /// A call that names a part of an engine past the end of what it has: a pipeline stage, a
    /// tensor-parallel rank, a serving lane, a device's local layer, a logit-adjustment row.
    #[error("invalid call: {what} {index} does not exist: there are {count}")]
    OutOfRange {
        /// What was indexed, e.g. `pipeline stage`.
        what: String,
        /// The index given.
        index: usize,
        /// How many there are (valid indices are `0..count`).
        count: usize,
    },
    /// A call that needs a part of the model that this device (or process) does not hold: the
    /// embedding, the LM head or the pooled output on a stage that does not end or start the
    /// model, or a layer whose weights were loaded elsewhere.
    #[error("invalid call: {holder} holds no {part}")]
    NotHeld {
        /// The part asked for, e.g. `LM head`.
        part: String,
        /// Who was asked, e.g. `the device of model 'default'`.
        holder: String,
    },
}

/// Result with [`WgparError`].
pub type Result<T> = std::result::Result<T, WgparError>;

/// Exit status of a command that failed while running: a device, file, model, link, rank or
/// the memory it needed.
pub const EXIT_FAILURE: i32 = 1;
/// Exit status of a usage error: what the user typed (as clap's own parse errors).
pub const EXIT_USAGE: i32 = 2;
/// Exit status of an internal error: a library call that does not fit the state it finds, or
/// a broken invariant (sysexits' EX_SOFTWARE).
pub const EXIT_INTERNAL: i32 = 70;

impl WgparError {
    /// [`WgparError::InvalidOption`]: `detail` names `option` and says what it accepts.
    pub fn option(option: impl Into<String>, detail: String) -> Self {
        Self::InvalidOption {
            option: option.into(),
            detail,
        }
    }

    /// [`WgparError::InvalidModel`] for `field` of `model`.
    pub fn model(model: impl Into<String>, field: impl Into<String>, detail: String) -> Self {
        Self::InvalidModel {
            model: model.into(),
            field: field.into(),
            detail,
        }
    }

    /// [`WgparError::Unsupported`].
    pub fn unsupported(detail: String) -> Self {
        Self::Unsupported { detail }
    }

    /// [`WgparError::ResourceLimit`]: `needed` of `resource` against `available`.
    pub fn limit(
        resource: impl Into<String>,
        (needed, available): (u64, u64),
        detail: String,
    ) -> Self {
        Self::ResourceLimit {
            resource: resource.into(),
            needed,
            available,
            detail,
        }
    }

    /// [`WgparError::Runtime`]: `what` failed because of `source`.
    pub fn runtime(
        what: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self::Runtime {
            what: what.into(),
            source: source.into(),
        }
    }

    /// The process exit status for this error, by class (docs/USAGE.md, "Exit status"):
    /// [`EXIT_USAGE`] for what the user typed (an option, switch or combination of them, as
    /// clap's own parse errors), [`EXIT_INTERNAL`] for a library call that does not fit the
    /// state it finds or a broken invariant (a bug in wgpar or in the program calling it), and
    /// [`EXIT_FAILURE`] for everything that failed while running (devices, files, models,
    /// links, ranks, memory).
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::InvalidOption { .. }
            | Self::Unsupported { .. }
            | Self::TuneSetting { .. }
            | Self::UnknownModel { .. }
            | Self::Hub(_) => EXIT_USAGE,
            Self::InvalidCall(_)
            | Self::LengthMismatch { .. }
            | Self::TooFew { .. }
            | Self::WrongStrategy { .. }
            | Self::SamplingRange { .. }
            | Self::StageCost { .. }
            | Self::KvCopy { .. }
            | Self::KvTable { .. }
            | Self::DecodeBeforePrefill
            | Self::DecodeTokens { .. }
            | Self::NoPrompt
            | Self::UnequalPrompts { .. }
            | Self::TokenRange { .. }
            | Self::WrongModelKind { .. }
            | Self::OutOfRange { .. }
            | Self::NotHeld { .. }
            | Self::Internal(_)
            | Self::Comm(
                crate::comm::CommError::RankState { .. }
                | crate::comm::CommError::WrongDevice { .. },
            ) => EXIT_INTERNAL,
            _ => EXIT_FAILURE,
        }
    }
}

/// Formats a byte count with a binary unit, e.g. `1.2 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

impl From<crate::sim::ProfileError> for WgparError {
    fn from(e: crate::sim::ProfileError) -> Self {
        WgparError::Profile(Box::new(e))
    }
}

// Every fallible call returns this by value: large payloads are boxed so that it stays under
// clippy's `result_large_err` bound (128 bytes), checked at compile time.
const _: () = assert!(
    std::mem::size_of::<WgparError>() < 128,
    "WgparError grew to 128 bytes or more: box the large variant"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_bytes_picks_binary_units() {
        assert_eq!(human_bytes(12), "12 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(256 << 20), "256.0 MiB");
    }

    #[test]
    fn checkpoint_message_names_file_and_tensor() {
        let e = WgparError::Checkpoint {
            file: "m/model.safetensors".into(),
            tensor: Some("wte.weight".into()),
            detail: "shape [3, 4], expected [5, 4]".into(),
        };
        assert_eq!(
            e.to_string(),
            "m/model.safetensors: tensor 'wte.weight': shape [3, 4], expected [5, 4]"
        );
        let e = WgparError::Checkpoint {
            file: "m/config.json".into(),
            tensor: None,
            detail: "no model_type".into(),
        };
        assert_eq!(e.to_string(), "m/config.json: no model_type");
    }

    #[test]
    fn too_large_message_states_both_numbers() {
        let e = WgparError::TooLarge {
            what: "layer 0 up-projection".into(),
            bytes: 3 << 30,
            limit: 256 << 20,
            kind: "buffer",
            adapter: "llvmpipe".into(),
        };
        let text = e.to_string();
        assert!(
            text.contains("3.0 GiB") && text.contains("256.0 MiB"),
            "{text}"
        );
    }
}

#[cfg(test)]
mod exit_codes {
    use super::*;

    #[test]
    fn usage_errors_exit_2_and_the_rest_1() {
        let usage = [
            WgparError::option("--max-seq", "--max-seq must be within 1..=8".into()),
            WgparError::unsupported("tp does not split 5 heads over 2 devices".into()),
        ];
        for e in &usage {
            assert_eq!(e.exit_code(), 2, "{e}");
        }
        let other = [
            WgparError::model("m", "heads", "model 'm': heads must be positive".into()),
            WgparError::limit("context (tokens)", (40, 32), "40 tokens exceed 32".into()),
            WgparError::runtime("the engine could not start", "no adapter".to_string()),
            WgparError::Config("free text".into()),
            WgparError::Grammar {
                after: Some(3),
                detail: "no token continues the value".into(),
            },
        ];
        for e in &other {
            assert_eq!(e.exit_code(), 1, "{e}");
        }
        let internal = [
            WgparError::DecodeBeforePrefill,
            WgparError::UnequalPrompts { first: 3, other: 4 },
            WgparError::Internal("broken".into()),
            WgparError::InvalidCall("out of order".into()),
            WgparError::LengthMismatch {
                what: "stage layer limits".into(),
                got: 3,
                expected: 2,
            },
            WgparError::TooFew {
                what: "timed steps".into(),
                got: 0,
                min: 1,
            },
            WgparError::WrongStrategy {
                strategy: "tp".into(),
                expected: "pipeline".into(),
            },
            WgparError::SamplingRange {
                top_k: 0,
                max_top_k: 64,
                temperature: 1.0,
                top_p: 1.0,
            },
            WgparError::StageCost {
                stage: 1,
                what: "layer".into(),
                seconds: -1.0,
            },
            WgparError::TokenRange {
                sequence: 2,
                what: "token id",
                value: 500,
                range: "vocabulary",
                limit: 397,
            },
            WgparError::WrongModelKind {
                model: "tiny-llama".into(),
                call: "a pooled embedding".into(),
                needs: "an encoder (BERT-style)",
            },
        ];
        for e in &internal {
            assert_eq!(e.exit_code(), EXIT_INTERNAL, "{e}");
        }
        // The message is the detail, which names the option; the numbers stay matchable.
        assert_eq!(usage[0].to_string(), "--max-seq must be within 1..=8");
        let WgparError::ResourceLimit {
            needed, available, ..
        } = &other[1]
        else {
            panic!("not a resource limit")
        };
        assert_eq!((*needed, *available), (40, 32));
        assert!(other[2].to_string().ends_with(": no adapter"));
        assert!(
            std::error::Error::source(&other[2]).is_some(),
            "the cause is kept"
        );
    }

    #[test]
    fn new_variants_say_what_and_carry_the_numbers() {
        let cases = [
            (
                WgparError::TokenRange {
                    sequence: 2,
                    what: "token id",
                    value: 500,
                    range: "vocabulary",
                    limit: 397,
                },
                "invalid call: sequence 2: token id 500 is outside the vocabulary of 397",
            ),
            (
                WgparError::WrongModelKind {
                    model: "tiny-llama".into(),
                    call: "a pooled embedding".into(),
                    needs: "an encoder (BERT-style)",
                },
                "invalid call: a pooled embedding needs an encoder (BERT-style), and model \
                 'tiny-llama' is not one",
            ),
            (
                WgparError::Grammar {
                    after: None,
                    detail: "no end-of-sequence token".into(),
                },
                "structured output needs the model's tokens as bytes: no end-of-sequence token",
            ),
            (
                WgparError::Grammar {
                    after: Some(7),
                    detail: "no token continues the value".into(),
                },
                "structured output failed after 7 tokens: no token continues the value",
            ),
            (
                WgparError::OutOfRange {
                    what: "pipeline stage".into(),
                    index: 4,
                    count: 2,
                },
                "invalid call: pipeline stage 4 does not exist: there are 2",
            ),
            (
                WgparError::NotHeld {
                    part: "LM head".into(),
                    holder: "this device (not the model's last stage)".into(),
                },
                "invalid call: this device (not the model's last stage) holds no LM head",
            ),
        ];
        for (e, _) in &cases[cases.len() - 2..] {
            assert_eq!(e.exit_code(), EXIT_INTERNAL, "{e}");
        }
        for (e, text) in cases {
            assert_eq!(e.to_string(), text);
        }
    }
}

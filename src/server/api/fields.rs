//! Every request field OpenAI, vLLM and llama-server define for `/v1/completions`,
//! `/v1/chat/completions` and `/v1/embeddings`, with what wgpar does with it. This one table drives the checks
//! (a field not in it, or refused by it, gets a 400 naming it) and the table in
//! docs/SERVING.md ([`markdown`]; a test keeps the two equal).

use serde_json::{Map, Value};

use super::Invalid;

/// Which route a field belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
    /// Both completions and chat.
    Both,
    /// `/v1/embeddings` (not covered by `Both`).
    Embeddings,
}

/// What wgpar does with a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Read and acted on.
    Honoured,
    /// Accepted; it does not change the output (bookkeeping fields).
    NoEffect,
    /// Accepted at this value (JSON), which changes nothing; any other value is refused.
    OnlyAt(&'static str),
    /// Refused with a 400 at any value but `null`.
    Refused,
}

/// One field.
#[derive(Debug, Clone, Copy)]
pub struct Field {
    /// Its JSON name.
    pub name: &'static str,
    /// The route(s) it belongs to.
    pub route: Route,
    /// Who defines it.
    pub origin: &'static str,
    /// What wgpar does.
    pub rule: Rule,
    /// A value the tests send: accepted for `Honoured` and `NoEffect`, refused otherwise.
    pub example: &'static str,
    /// What it does in wgpar, for the docs.
    pub note: &'static str,
}

const fn f(
    name: &'static str,
    route: Route,
    origin: &'static str,
    rule: Rule,
    example: &'static str,
    note: &'static str,
) -> Field {
    Field {
        name,
        route,
        origin,
        rule,
        example,
        note,
    }
}

use Route::{Both, Chat, Completions as Text, Embeddings as Emb};
use Rule::{Honoured as H, NoEffect as N, OnlyAt as At, Refused as R};

const OA: &str = "OpenAI";
const VL: &str = "vLLM";
const LS: &str = "llama-server";
const NO_GRAMMAR: &str = "refused: use `response_format` (JSON object or schema)";
const NO_SAMPLER: &str = "wgpar has no such sampler";

/// The table, in the order the docs list it.
pub const FIELDS: &[Field] = &[
    f("model", Both, OA, H, r#""m""#, "must name the served model (`--served-model-name`); 404 otherwise"),
    f("prompt", Text, OA, H, r#"["t1 t2", [5, 6]]"#, "a string, token ids, or a list of either: one choice each"),
    f("messages", Chat, OA, H, r#"[{"role":"user","content":"t1"}]"#, "rendered by the chat template; `content` a string or text parts"),
    f("max_tokens", Both, OA, H, "2", "most tokens to generate (default 16 for completions, the rest of the context for chat; 0 with `echo` scores the prompt only)"),
    f("max_completion_tokens", Chat, OA, H, "2", "as `max_tokens`"),
    f("n_predict", Both, LS, H, "2", "as `max_tokens`"),
    f("n", Both, OA, H, "2", "choices per prompt, up to 8 (each its own sequence; with the prefix cache, the first prefills the prompt and the others reuse its KV, prefilling only the tail past its last whole block: see Prefix caching)"),
    f("best_of", Text, OA, At("1"), "2", "only 1: no ranking of choices"),
    f("stream", Both, OA, H, "false", "Server-Sent Events"),
    f("stream_options", Both, OA, H, r#"{"include_usage":true}"#, "`include_usage`: a last chunk with `usage`"),
    f("stop", Both, OA, H, r#"["t9"]"#, "a string or up to 4: the text ends before the first"),
    f("stop_token_ids", Both, VL, H, "[9]", "tokens that end the text like end-of-sequence (not shown)"),
    f("ignore_eos", Both, VL, H, "true", "generate past end-of-sequence tokens (`stop_token_ids` still stop)"),
    f("temperature", Both, OA, H, "0.5", "0..2, default 1; 0 is greedy"),
    f("top_p", Both, OA, H, "0.9", "nucleus sampling"),
    f("top_k", Both, VL, H, "5", "keep the k most likely (-1 or 0: all)"),
    f("min_p", Both, VL, H, "0.1", "drop tokens less likely than this share of the most likely"),
    f("seed", Both, OA, H, "7", "seeds the draws (choice i of `n` uses seed + i)"),
    f("logit_bias", Both, OA, H, r#"{"5": -100}"#, "token id -> bias in -100..100, added to the logit; at most 300 entries, each token once"),
    f("allowed_token_ids", Both, VL, H, "[5, 6, 7]", "only these tokens may be picked"),
    f("presence_penalty", Both, OA, H, "0.5", "-2..2, subtracted once from generated tokens' logits"),
    f("frequency_penalty", Both, OA, H, "0.5", "-2..2, subtracted per occurrence among generated tokens"),
    f("repetition_penalty", Both, VL, H, "1.2", "0..=10 (exclusive of 0): prompt and generated tokens' logits divided (positive) or multiplied (negative)"),
    f("repeat_penalty", Both, LS, H, "1.2", "as `repetition_penalty`"),
    f("logprobs", Text, OA, H, "2", "0..=20: each token's log-prob and the top k"),
    f("logprobs", Chat, OA, H, "true", "each token's log-prob (`top_logprobs` for the top k)"),
    f("top_logprobs", Chat, OA, H, "2", "0..=20, with `logprobs: true`"),
    f("echo", Text, OA, H, "true", "the prompt comes first in the text; with `logprobs`, its tokens' log-probs too"),
    f("echo", Chat, VL, At("false"), "true", "only false"),
    f("add_generation_prompt", Chat, VL, H, "true", "the template's `add_generation_prompt` (default true)"),
    f("suffix", Text, OA, R, r#""x""#, "refused: no fill-in-the-middle"),
    f("user", Both, OA, N, r#""u""#, "no effect"),
    f("metadata", Chat, OA, N, r#"{"k":"v"}"#, "no effect"),
    f("store", Chat, OA, N, "true", "no effect (nothing is stored)"),
    f("service_tier", Chat, OA, N, r#""auto""#, "no effect"),
    f("prompt_cache_key", Chat, OA, N, r#""k""#, "no effect"),
    f("safety_identifier", Chat, OA, N, r#""s""#, "no effect"),
    f("parallel_tool_calls", Chat, OA, H, "true", "false: only the first tool call is returned"),
    f("request_id", Both, VL, N, r#""r1""#, "no effect"),
    f("cache_salt", Both, VL, H, r#""s""#, "the prompt shares cached KV only with requests of the same salt (a non-empty string)"),
    f("cache_prompt", Both, LS, H, "false", "false: the prompt is prefilled whole, reusing no cached KV (default true)"),
    f("id_slot", Both, LS, N, "0", "no effect (the scheduler picks the slot)"),
    f("response_format", Both, OA, H, r#"{"type":"text"}"#, "`text`, `json_object`, or `json_schema` (its `schema` enforced while decoding, `strict` or not: a token mask per step); other types 400. Needs a byte-level or byte-fallback tokenizer"),
    f("tools", Chat, OA, H, r#"[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]"#, "function definitions, rendered by the chat template as `tools` (400 if it does not read them); calls in the answer come back as `tool_calls`"),
    f("tool_choice", Chat, OA, H, r#""none""#, "`auto` (the default with tools), `none` (tools not rendered, the answer not parsed), `required` or a named function (the answer held to the calls' JSON schema by the structured-output mask, returned as `tool_calls`; 400 beside `response_format`, `min_tokens` or `allowed_token_ids`)"),
    f("functions", Chat, OA, R, "[]", "refused: deprecated, use `tools`"),
    f("function_call", Chat, OA, R, r#""auto""#, "refused: deprecated, use `tool_choice`"),
    f("modalities", Chat, OA, At(r#"["text"]"#), r#"["audio"]"#, "only text"),
    f("audio", Chat, OA, R, r#"{"voice":"x"}"#, "refused: text only"),
    f("prediction", Chat, OA, R, r#"{"type":"content","content":"x"}"#, "refused: no predicted outputs"),
    f("reasoning_effort", Chat, OA, R, r#""low""#, "refused: not a reasoning model setting wgpar has"),
    f("verbosity", Chat, OA, R, r#""low""#, "refused"),
    f("web_search_options", Chat, OA, R, "{}", "refused: no web search"),
    f("use_beam_search", Both, VL, At("false"), "true", "only false: no beam search"),
    f("length_penalty", Both, VL, At("1"), "0.5", "only 1 (beam search only)"),
    f("min_tokens", Both, VL, H, "1", "end tokens (end-of-sequence, `stop_token_ids`) cannot be picked, and stop strings do not stop, before this many tokens"),
    f("include_stop_str_in_output", Both, VL, H, "true", "the text keeps the stop string that ended it"),
    f("skip_special_tokens", Both, VL, At("true"), "false", "only true"),
    f("spaces_between_special_tokens", Both, VL, At("true"), "false", "only true"),
    f("add_special_tokens", Text, VL, At("true"), "false", "only true (a text prompt gets the tokenizer's special tokens)"),
    f("add_special_tokens", Chat, VL, At("false"), "true", "only false (the template writes them)"),
    f("continue_final_message", Chat, VL, At("false"), "true", "only false"),
    f("return_tokens_as_token_ids", Both, VL, At("false"), "true", "only false"),
    f("return_token_ids", Both, VL, At("false"), "true", "only false"),
    f("priority", Both, VL, At("0"), "1", "only 0: no priority scheduling"),
    f("truncate_prompt_tokens", Both, VL, R, "4", "refused: prompts are never truncated"),
    f("prompt_logprobs", Both, VL, R, "1", "refused: use `echo` with `logprobs`"),
    f("bad_words", Both, VL, R, r#"["x"]"#, "refused"),
    f("logits_processors", Both, VL, R, r#"["x"]"#, "refused"),
    f("guided_json", Both, VL, H, "null", "a JSON schema (object or its text), enforced as `response_format` `json_schema`; 400 beside `response_format` or another `guided_*`"),
    f("guided_regex", Both, VL, H, "null", "a regular expression (Rust `regex` syntax) the whole text is held to while decoding, by the same token mask"),
    f("guided_choice", Both, VL, H, "null", "a list of strings: the text is exactly one of them, by the same token mask"),
    f("guided_grammar", Both, VL, R, r#""x""#, NO_GRAMMAR),
    f("guided_decoding_backend", Both, VL, R, r#""x""#, NO_GRAMMAR),
    f("guided_whitespace_pattern", Both, VL, R, r#""x""#, NO_GRAMMAR),
    f("structured_outputs", Both, VL, R, "{}", NO_GRAMMAR),
    f("grammar", Both, LS, R, r#""x""#, NO_GRAMMAR),
    f("json_schema", Both, LS, R, "{}", NO_GRAMMAR),
    f("kv_transfer_params", Both, VL, R, "{}", "refused"),
    f("vllm_xargs", Both, VL, R, "{}", "refused"),
    f("documents", Chat, VL, R, "[]", "refused"),
    f("chat_template", Chat, VL, R, r#""x""#, "refused: `serve --chat-template FILE` sets it"),
    f("chat_template_kwargs", Chat, VL, R, "{}", "refused"),
    f("mm_processor_kwargs", Chat, VL, R, "{}", "refused: text only"),
    f("typical_p", Both, LS, At("1"), "0.5", NO_SAMPLER),
    f("tfs_z", Both, LS, At("1"), "0.5", NO_SAMPLER),
    f("min_keep", Both, LS, At("0"), "2", "only 0"),
    f("repeat_last_n", Both, LS, At("-1"), "64", "only -1: penalties see every token"),
    f("penalize_nl", Both, LS, At("false"), "true", "only false"),
    f("mirostat", Both, LS, At("0"), "2", NO_SAMPLER),
    f("mirostat_tau", Both, LS, R, "5", NO_SAMPLER),
    f("mirostat_eta", Both, LS, R, "0.1", NO_SAMPLER),
    f("dynatemp_range", Both, LS, At("0"), "0.5", NO_SAMPLER),
    f("dynatemp_exponent", Both, LS, At("1"), "2", NO_SAMPLER),
    f("dry_multiplier", Both, LS, At("0"), "0.8", NO_SAMPLER),
    f("dry_base", Both, LS, R, "1.75", NO_SAMPLER),
    f("dry_allowed_length", Both, LS, R, "2", NO_SAMPLER),
    f("dry_penalty_last_n", Both, LS, R, "-1", NO_SAMPLER),
    f("dry_sequence_breakers", Both, LS, R, r#"["\n"]"#, NO_SAMPLER),
    f("xtc_probability", Both, LS, At("0"), "0.5", NO_SAMPLER),
    f("xtc_threshold", Both, LS, R, "0.1", NO_SAMPLER),
    f("top_n_sigma", Both, LS, At("-1"), "1", NO_SAMPLER),
    f("samplers", Both, LS, R, r#"["top_k"]"#, "refused: the order is fixed"),
    f("n_probs", Both, LS, At("0"), "2", "only 0: use `logprobs`"),
    f("post_sampling_probs", Both, LS, At("false"), "true", "only false"),
    f("n_keep", Both, LS, At("0"), "4", "only 0: no context shift"),
    f("n_indent", Both, LS, At("0"), "4", "only 0"),
    f("t_max_predict_ms", Both, LS, At("0"), "100", "only 0: no time limit"),
    f("image_data", Both, LS, R, "[]", "refused: text only"),
    f("lora", Both, LS, R, "[]", "refused: no adapters"),
    f("return_tokens", Both, LS, At("false"), "true", "only false"),
    f("timings_per_token", Both, LS, At("false"), "true", "only false"),
    f("response_fields", Both, LS, R, r#"["content"]"#, "refused"),
    f("input", Emb, OA, H, r#"["a b", [101, 102]]"#, "a string, a list of strings, token ids, or a list of token-id lists: one embedding each (token ids are used as given)"),
    f("model", Emb, OA, H, r#""m""#, "must name the served model; 404 otherwise"),
    f("encoding_format", Emb, OA, H, r#""base64""#, "`float` (default) or `base64` (little-endian f32)"),
    f("dimensions", Emb, OA, H, "384", "only the model's own width (no truncated embeddings); 400 otherwise"),
    f("user", Emb, OA, N, r#""u""#, "no effect"),
    f("request_id", Emb, VL, N, r#""r1""#, "no effect"),
    f("priority", Emb, VL, At("0"), "1", "only 0: no priority scheduling"),
    f("add_special_tokens", Emb, VL, At("true"), "false", "only true (text inputs get the tokenizer's [CLS] and [SEP])"),
    f("truncate_prompt_tokens", Emb, VL, R, "4", "refused: texts are cut only where the checkpoint's tokenizer cuts them"),
    f("normalize", Emb, VL, R, "true", "refused: the checkpoint's Normalize module decides"),
    f("embed_dtype", Emb, VL, At(r#""float32""#), r#""float16""#, "only float32"),
    f("use_activation", Emb, VL, R, "true", "refused"),
    f("messages", Emb, VL, R, "[]", "refused: embed `input`"),
    f("content", Emb, LS, R, r#""x""#, "refused: use `input`"),
    f("embd_normalize", Emb, LS, R, "2", "refused: the checkpoint's Normalize module decides"),
];

fn applies(field: &Field, route: Route) -> bool {
    let both = field.route == Route::Both && route != Route::Embeddings;
    both || field.route == route
}

/// Numbers compare by value (1 and 1.0 are the same), the rest exactly.
fn same(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// Checks every field of `obj` against the table for `route`: unknown, refused and
/// off-default fields get a 400 naming them. `null` counts as absent.
pub fn check(obj: &Map<String, Value>, route: Route) -> Result<(), Invalid> {
    for (name, value) in obj.iter().filter(|(_, v)| !v.is_null()) {
        let Some(field) = FIELDS.iter().find(|f| f.name == name && applies(f, route)) else {
            let other = FIELDS.iter().any(|f| f.name == name);
            let why = if other {
                "belongs to the other route"
            } else {
                "is not a field wgpar knows"
            };
            return Err(Invalid::new(name, format!("'{name}' {why}")));
        };
        match field.rule {
            Rule::Honoured | Rule::NoEffect => {}
            Rule::OnlyAt(only) => {
                let want: Value = serde_json::from_str(only).unwrap_or(Value::Null);
                if !same(value, &want) {
                    return Err(Invalid::new(
                        name,
                        format!(
                            "'{name}' is {value}: wgpar takes only {only} ({})",
                            field.note
                        ),
                    ));
                }
            }
            Rule::Refused => {
                return Err(Invalid::new(
                    name,
                    format!("'{name}' is not supported ({})", field.note),
                ))
            }
        }
    }
    Ok(())
}

/// The docs' table of every field.
pub fn markdown() -> String {
    let mut out = String::from("| field | route | from | wgpar |\n|---|---|---|---|\n");
    for f in FIELDS {
        let route = match f.route {
            Route::Completions => "completions",
            Route::Chat => "chat",
            Route::Both => "both",
            Route::Embeddings => "embeddings",
        };
        let what = match f.rule {
            Rule::Honoured => format!("honoured: {}", f.note),
            Rule::NoEffect => format!("accepted, {}", f.note),
            Rule::OnlyAt(v) => format!("`{v}` accepted; else 400: {}", f.note),
            Rule::Refused => match f.note.strip_prefix("refused") {
                Some(rest) => format!("400{rest}"),
                None => format!("400: {}", f.note),
            },
        };
        out.push_str(&format!(
            "| `{}` | {route} | {} | {what} |\n",
            f.name, f.origin
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_example_parses_and_every_default_parses() {
        for f in FIELDS {
            serde_json::from_str::<Value>(f.example).unwrap_or_else(|e| panic!("{}: {e}", f.name));
            if let Rule::OnlyAt(v) = f.rule {
                serde_json::from_str::<Value>(v).unwrap_or_else(|e| panic!("{}: {e}", f.name));
            }
        }
    }

    #[test]
    fn docs_hold_the_table() {
        let docs = include_str!("../../../docs/SERVING.md");
        assert!(
            docs.contains(&markdown()),
            "docs/SERVING.md lacks the current field table; it is:\n{}",
            markdown()
        );
    }
}

//! The pre-tokenizers of byte-level BPE vocabularies, by `tokenizer.ggml.pre` value: the
//! names llama.cpp's vocabulary loader gives them, each rebuilt in the form the model
//! family's own `tokenizer.json` takes (its `pre_tokenizer`, `normalizer` and BPE options).
//!
//! The table is data: each entry lists the values that share one set of rules. Regexes are
//! those of the families' `tokenizer.json` files (case-insensitive groups and letter classes
//! as written there, not llama.cpp's hand-expanded equivalents).

use serde_json::{json, Value as Json};

/// One step of a pre-tokenizer `Sequence`.
#[derive(Debug, Clone, Copy)]
pub enum Step {
    /// `Split` on a regex, each match a piece of its own (behavior `Isolated`).
    Split(&'static str),
    /// `Digits`: every digit alone (`true`), or runs of digits apart from the rest.
    Digits(bool),
    /// `Punctuation` runs apart from the rest (behavior `Contiguous`).
    Punctuation,
    /// GPT-2's own split, as the `ByteLevel` step with `use_regex` performs it. Without this
    /// step, a `ByteLevel` step that only maps bytes ends the sequence.
    Gpt2,
}

/// The rules one group of `tokenizer.ggml.pre` values shares.
#[derive(Debug)]
pub struct PreRules {
    /// The values, as llama.cpp's converter writes them.
    pub names: &'static [&'static str],
    /// The pre-tokenizer, in order.
    pub steps: &'static [Step],
    /// Text is NFC-normalized first (Qwen2).
    pub nfc: bool,
    /// A word that is itself a token is taken whole, without merging (Llama 3).
    pub ignore_merges: bool,
    /// BOS is added when the file has no `tokenizer.ggml.add_bos_token`.
    pub add_bos: bool,
}

/// `tokenizer.ggml.pre` values llama.cpp knows whose vocabularies are not byte-level BPE with
/// a regex pre-tokenizer, with why wgpar does not rebuild them.
pub const NOT_REBUILT: &[(&str, &str)] = &[
    ("kimi-k2", "its split is custom code, not a regex"),
    ("afmoe", "its digit grouping is custom code, not a regex"),
    ("gemma4", "it is SentencePiece-style BPE over raw UTF-8"),
    (
        "granite-embed-multi-311m",
        "it is SentencePiece-style BPE over raw UTF-8",
    ),
    ("sarvam-moe", "it is SentencePiece-style BPE over raw UTF-8"),
    ("whitespace", "it is a whitespace word tokenizer"),
    (
        "jina-v1-en",
        "it appends a separator token (an embedding model)",
    ),
    (
        "jina-v2-code",
        "it appends a separator token (an embedding model)",
    ),
    (
        "roberta-bpe",
        "it appends a separator token (an embedding model)",
    ),
];

const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const JAIS2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}";
/// Upper-then-lower letter runs with an optional contraction (GPT-4o's `o200k` split).
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const YOUTU_CJK: &str = r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+";
const YOUTU: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DEEPSEEK_LETTERS: &str = "\\s?[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}\u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-\u{38A}\u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}\u{1FC2}-\u{1FC4}\u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}\u{1FF2}-\u{1FF4}\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\u{2145}-\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}]+";
const DEEPSEEK_PUNCT: &str = r"\s?[!-/:-~！-／：-～‘-‟　-。]+";
const DEEPSEEK_CJK: &str = r"[一-龥ࠀ-一가-퟿]+";
const KANA_HAN: &str = r"[一-龥぀-ゟ゠-ヿ]+";
const DEEPSEEK3: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;
const SPARK: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"##;
/// Words with the space before them, cut at spaces and sentence punctuation (BLOOM).
const BLOOM: &str = r" ?[^(\s|.,!?…。，、।۔،)]+";
const BAILING: &str = r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
const SEED_CODER: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split without the contractions (Turkish suffixes after an apostrophe stay on).
const UFAKZEKA: &str =
    r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const EXAONE_MOE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+";
const MINICPM5: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const fn rules(names: &'static [&'static str], steps: &'static [Step]) -> PreRules {
    PreRules {
        names,
        steps,
        nfc: false,
        ignore_merges: false,
        add_bos: false,
    }
}

use Step::{Digits, Gpt2, Punctuation, Split};

/// Every `tokenizer.ggml.pre` value wgpar rebuilds, grouped by shared rules. A file without
/// the key gets `default`, as in llama.cpp.
pub const PRE_RULES: &[PreRules] = &[
    rules(
        &["default", "falcon"],
        &[Punctuation, Gpt2, Digits(false), Split("[0-9][0-9][0-9]")],
    ),
    rules(
        &[
            "gpt-2",
            "gpt2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ],
        &[Gpt2],
    ),
    rules(
        &[
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        &[Digits(true), Gpt2],
    ),
    PreRules {
        ignore_merges: true,
        add_bos: true,
        ..rules(
            &[
                "llama3",
                "llama-v3",
                "llama-bpe",
                "falcon3",
                "falcon-h1",
                "pixtral",
                "midm-2.0",
                "lfm2",
                "jina-v5-nano",
            ],
            &[Split(LLAMA3)],
        )
    },
    rules(
        &["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"],
        &[Split(LLAMA3)],
    ),
    rules(&["jais-2"], &[Split(JAIS2)]),
    PreRules {
        nfc: true,
        ..rules(&["qwen2"], &[Split(QWEN2)])
    },
    PreRules {
        nfc: true,
        ..rules(&["qwen35"], &[Split(QWEN35)])
    },
    rules(
        &[
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ],
        &[Split(QWEN2)],
    ),
    rules(
        &["deepseek-llm"],
        &[
            Split(r"[\r\n]"),
            Split(DEEPSEEK_LETTERS),
            Split(DEEPSEEK_PUNCT),
            Split(r"\s+$"),
            Split(DEEPSEEK_CJK),
            Digits(false),
        ],
    ),
    rules(
        &["deepseek-coder"],
        &[
            Split(r"[\r\n]"),
            Split(r"\s?\p{L}+"),
            Split(r"\s?\p{P}+"),
            Split(DEEPSEEK_CJK),
            Digits(true),
        ],
    ),
    rules(
        &["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"],
        &[Split(r"\p{N}{1,3}"), Split(KANA_HAN), Split(DEEPSEEK3)],
    ),
    rules(
        &["spark2_5"],
        &[
            Split(r"\p{N}{1,3}"),
            Split(KANA_HAN),
            Split(SPARK),
            Digits(true),
        ],
    ),
    PreRules {
        ignore_merges: true,
        ..rules(&["youtu"], &[Split(YOUTU_CJK), Split(YOUTU)])
    },
    rules(&["poro-chat", "bloom", "gpt3-finnish"], &[Split(BLOOM)]),
    rules(&["viking"], &[Split(BLOOM), Digits(true)]),
    PreRules {
        ignore_merges: true,
        add_bos: true,
        ..rules(&["tekken"], &[Split(TEKKEN)])
    },
    PreRules {
        add_bos: true,
        ..rules(
            &["chameleon"],
            &[
                Split("<sentinel:[0-9]+>"),
                Split("(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z"),
                Split("([\\t\\n]|    |  )"),
                Digits(true),
                Split(r"[\p{P}!-/:-@\[-`{-~]"),
                Gpt2,
            ],
        )
    },
    rules(
        &["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
        &[Split(GPT4O)],
    ),
    PreRules {
        ignore_merges: true,
        ..rules(&["granite-embed-multi-97m"], &[Split(GPT4O)])
    },
    rules(
        &["tiny_aya", "cohere2moe"],
        &[Split(r"\d{1,3}(?=(?:\d{3})*\b)"), Split(GPT4O)],
    ),
    rules(
        &["superbpe"],
        &[Split(r"\p{N}+"), Split(r"(?=(\d{3})+(?!\d))")],
    ),
    rules(
        &["bailingmoe", "bailingmoe2", "llada-moe"],
        &[Split(BAILING)],
    ),
    rules(&["seed-coder"], &[Split(SEED_CODER)]),
    rules(&["ufakzeka"], &[Split(UFAKZEKA)]),
    rules(&["laguna"], &[Split(r"[^\n]+|[\n]+"), Split(QWEN2)]),
    rules(&["exaone-moe"], &[Split(EXAONE_MOE)]),
    PreRules {
        ignore_merges: true,
        ..rules(&["minicpm5"], &[Split(r"\p{N}{1,3}"), Split(MINICPM5)])
    },
];

/// The rules of `pre`, if wgpar rebuilds it.
pub fn rules_of(pre: &str) -> Option<&'static PreRules> {
    PRE_RULES.iter().find(|r| r.names.contains(&pre))
}

fn byte_level(use_regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
           "use_regex": use_regex})
}

impl PreRules {
    /// The `pre_tokenizer` section: the steps, with the bytes mapped to GPT-2's characters
    /// at the GPT-2 step or, where there is none, last.
    pub fn pre_tokenizer(&self) -> Json {
        let mut steps: Vec<Json> = self
            .steps
            .iter()
            .map(|s| match *s {
                Split(re) => json!({"type": "Split", "pattern": {"Regex": re},
                                    "behavior": "Isolated", "invert": false}),
                Digits(individual) => json!({"type": "Digits", "individual_digits": individual}),
                Punctuation => json!({"type": "Punctuation", "behavior": "Contiguous"}),
                Gpt2 => byte_level(true),
            })
            .collect();
        if !self.steps.iter().any(|s| matches!(s, Gpt2)) {
            steps.push(byte_level(false));
        }
        json!({"type": "Sequence", "pretokenizers": steps})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_has_one_rule_and_every_regex_compiles() {
        let mut seen = std::collections::HashSet::new();
        for r in PRE_RULES {
            for n in r.names {
                assert!(seen.insert(*n), "'{n}' is in two groups");
                assert!(!NOT_REBUILT.iter().any(|(x, _)| x == n), "'{n}'");
            }
            let all = r.pre_tokenizer();
            for step in all["pretokenizers"].as_array().unwrap() {
                serde_json::from_str::<tokenizers::PreTokenizerWrapper>(&step.to_string())
                    .unwrap_or_else(|e| panic!("{:?}: {step}: {e}", r.names));
            }
        }
        assert!(seen.len() > 80, "{} values", seen.len());
        // docs/MODELS.md lists every value rebuilt and every value refused.
        let doc = include_str!("../../../../docs/MODELS.md");
        for n in seen.iter().chain(NOT_REBUILT.iter().map(|(n, _)| n)) {
            assert!(
                doc.contains(&format!("`{n}`")),
                "docs/MODELS.md lacks `{n}`"
            );
        }
    }
}

"""Reference ids for wgpar's GGUF pre-tokenizers, from Hugging Face's `tokenizers` library.

Usage: python pretokenizers.py OUT_DIR

Learns one byte-level BPE vocabulary from a sample with no pre-tokenization (so its merges
cross spaces, digits, punctuation and newlines, and every splitting rule shows in the ids), then
for each `tokenizer.ggml.pre` value builds a `tokenizers.Tokenizer` from that vocabulary and its
merges with the family's rules as its own tokenizer.json writes them (written here, apart from
wgpar's table), encodes the corpus, and writes a GGUF file with the vocabulary as llama.cpp's
converter stores it. OUT_DIR/cases.json lists each case: file, pre value, texts and ids.

With --gguf FILE instead, reads the vocabulary and merges of a released GGUF file and writes the
ids of its pre value's rules to OUT_DIR/cases.json (one case, that file).
"""
import json
import os
import sys

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

CORPUS = [
    "The year 2026 had 1234567 visitors, 3.14159 of them twice; call 555-0199 or +44 20 7946 0958.",
    "It's here, I'M sure, we'll see; they'RE late, you've won, she'd go, can't stop - O'Neil's.",
    "Wait!!! What?!... (yes) [no] {maybe} --> ==> ;;; ''quoted'' \"double\" $$$ 100% ~~ ^^ ||",
    "日本語のテキストと中文字符，还有한국어 문장。カタカナ and ひらがな mixed 漢字123",
    "emoji 🦀🚀 and 👍🏽 family 👨‍👩‍👧 flags 🇫🇷 hearts ❤️❤️",
    "  leading\t\ttabs   and   spaces  \n\n\n  trailing   \r\n  ",
    "def f(x):\n    return x**2 + 1  # comment\n\nfor i in range(10):\n\tprint(f\"{i:03d}\")\n",
    "Cafe\u0301 nai\u0308ve résumé, ﬁ ligature, Ⅻ roman, ½ fraction, ١٢٣ Arabic digits",
    "Mixed CamelCaseWords HTTPServer iPhone XMLHttpRequest getHTTPResponseCode",
    "<sentinel:12> IMGIMGABZ tokens, Привет мир, Ελληνικά, हिन्दी।",
]

SAMPLE = "\n".join(CORPUS * 3) + (
    "\nthe the the and and of of to to in in 2026 2026 123 456 789 000 "
    "it's it's I'll we're they've you'd don't\n    indented code    block\n\n\n"
    "!!! ??? ... --- === ''' \"\"\" ### ```\n"
)

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
          r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
JAIS2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)"
         r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
CONTR = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{UPPER}*{LOWER}+{CONTR}?|[^\r\n\p{{L}}\p{{N}}]?{UPPER}+{LOWER}*{CONTR}?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{UPPER}*{LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{UPPER}+{LOWER}*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
YOUTU = (rf"[^\r\n\p{{L}}\p{{N}}]?{UPPER}*{LOWER}+{CONTR}?|[^\r\n\p{{L}}\p{{N}}]?{UPPER}+{LOWER}*{CONTR}?"
         r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
YOUTU_CJK = "[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+"
DS_LETTERS = ("\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
              "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
              "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
              "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
              "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
              "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
              "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
              "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
              "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
              "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
              "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
              "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
              "\U000118a0-\U000118df\U0001e900-\U0001e943]+")
DS_PUNCT = "\\s?[!-/:-~！-／：-～‘-‟　-。]+"
DS_CJK = "[一-龥ࠀ-一가-퟿]+"
KANA_HAN = "[一-龥぀-ゟ゠-ヿ]+"
DS3 = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
       r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPARK = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
         r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+")
BLOOM = r" ?[^(\s|[.,!?…。，、।۔،])]+"
BAILING = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*"
           r"|\s*[\r\n]|\s+(?!\S)|\s+")
SEED = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+")
UFAK = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
EXAONE_MOE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
MINICPM = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def split(regex):
    return pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)


def byte_level(use_regex):
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def digits(individual):
    return pre_tokenizers.Digits(individual_digits=individual)


def regexes(*res):
    """Splits on each regex in turn, then bytes to GPT-2's characters."""
    return [split(r) for r in res] + [byte_level(False)]


# (pre values, pre-tokenizers, options): nfc, ignore_merges, add_bos (when the file is silent).
FAMILIES = [
    (["default", "falcon"],
     lambda: [pre_tokenizers.Punctuation(behavior="contiguous"), byte_level(True), digits(False),
              split("[0-9][0-9][0-9]")], {}),
    (["gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
      "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling",
      "exaone4"], lambda: [byte_level(True)], {}),
    (["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"],
     lambda: [digits(True), byte_level(True)], {}),
    (["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
      "jina-v5-nano"], lambda: regexes(LLAMA3), {"ignore_merges": True, "add_bos": True}),
    (["dbrx", "smaug-bpe", "glm4", "chatglm-bpe"], lambda: regexes(LLAMA3), {}),
    (["jais-2"], lambda: regexes(JAIS2), {}),
    (["qwen2"], lambda: regexes(QWEN2), {"nfc": True}),
    (["qwen35"], lambda: regexes(QWEN35), {"nfc": True}),
    (["deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open",
      "grok-2"], lambda: regexes(QWEN2), {}),
    (["deepseek-llm"],
     lambda: [split(r"[\r\n]"), split(DS_LETTERS), split(DS_PUNCT), split(r"\s+$"), split(DS_CJK),
              digits(False), byte_level(False)], {}),
    (["deepseek-coder"],
     lambda: [split(r"[\r\n]"), split(r"\s?\p{L}+"), split(r"\s?\p{P}+"), split(DS_CJK),
              digits(True), byte_level(False)], {}),
    (["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"],
     lambda: regexes(r"\p{N}{1,3}", KANA_HAN, DS3), {}),
    (["spark2_5"],
     lambda: [split(r"\p{N}{1,3}"), split(KANA_HAN), split(SPARK), digits(True), byte_level(False)],
     {}),
    (["youtu"], lambda: regexes(YOUTU_CJK, YOUTU), {"ignore_merges": True}),
    (["poro-chat", "bloom", "gpt3-finnish"], lambda: regexes(BLOOM), {}),
    (["viking"], lambda: [split(BLOOM), digits(True), byte_level(False)], {}),
    (["tekken"], lambda: regexes(TEKKEN), {"ignore_merges": True, "add_bos": True}),
    (["chameleon"],
     lambda: [split("<sentinel:[0-9]+>"), split("(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z"),
              split("([\\t\\n]|    |  )"), digits(True), split(r"[\p{P}!-/:-@\[-`{-~]"),
              byte_level(True)], {"add_bos": True}),
    (["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], lambda: regexes(GPT4O), {}),
    (["granite-embed-multi-97m"], lambda: regexes(GPT4O), {"ignore_merges": True}),
    (["tiny_aya", "cohere2moe"], lambda: regexes(r"\d{1,3}(?=(?:\d{3})*\b)", GPT4O), {}),
    (["superbpe"], lambda: regexes(r"\p{N}+", r"(?=(\d{3})+(?!\d))"), {}),
    (["bailingmoe", "bailingmoe2", "llada-moe"], lambda: regexes(BAILING), {}),
    (["seed-coder"], lambda: regexes(SEED), {}),
    (["ufakzeka"], lambda: regexes(UFAK), {}),
    (["laguna"], lambda: regexes(r"[^\n]+|[\n]+", QWEN2), {}),
    (["exaone-moe"], lambda: regexes(EXAONE_MOE), {}),
    (["minicpm5"], lambda: regexes(r"\p{N}{1,3}", MINICPM), {"ignore_merges": True}),
]

# Cases beyond each value with the file silent: the file's own add_bos_token / add_eos_token /
# add_space_prefix, which override the family's defaults.
FLAG_CASES = [
    ("llama-bpe", {"add_bos": False, "add_eos": True}),
    ("smollm", {"add_bos": True, "add_eos": True}),
    ("qwen2", {"add_space_prefix": True}),
    ("gpt-2", {"add_space_prefix": True, "add_bos": True}),
]

BOS, EOS = "<|bos|>", "<|eos|>"


def learn_vocab():
    """Byte-level BPE learned over whole lines: merges span every kind of boundary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = byte_level(False)
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SAMPLE.split("\n"), trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, list) else m.split(" ", 1) for m in model["merges"]]
    return model["vocab"], [tuple(m) for m in merges]


def family(pre):
    for names, steps, opts in FAMILIES:
        if pre in names:
            return steps, opts
    raise KeyError(pre)


def build(pre, vocab, merges, flags):
    """The tokenizer of `pre` over the vocabulary, with the file's flags (None: silent)."""
    steps, opts = family(pre)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=opts.get("ignore_merges", False)))
    norms = []
    if opts.get("nfc"):
        norms.append(normalizers.NFC())
    if flags.get("add_space_prefix"):
        norms.append(normalizers.Prepend(" "))
    if norms:
        tok.normalizer = normalizers.Sequence(norms)
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps())
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    add_bos = flags.get("add_bos", opts.get("add_bos", False))
    add_eos = flags.get("add_eos", False)
    if add_bos or add_eos:
        single = ([BOS] if add_bos else []) + ["$A"] + ([EOS] if add_eos else [])
        pair = single + [t if t != "$A" else "$B:1" for t in single]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair),
            special_tokens=[(BOS, vocab[BOS]), (EOS, vocab[EOS])])
    return tok


def write_gguf(path, pre, vocab, merges, flags):
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in (BOS, EOS) else 1 for t in tokens])
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(vocab[BOS])
    w.add_eos_token_id(vocab[EOS])
    for flag, value in flags.items():
        getattr(w, {"add_bos": "add_add_bos_token", "add_eos": "add_add_eos_token",
                    "add_space_prefix": "add_add_space_prefix"}[flag])(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def case(out, name, pre, vocab, merges, flags):
    path = os.path.join(out, f"{name}.gguf")
    write_gguf(path, pre, vocab, merges, flags)
    tok = build(pre or "default", vocab, merges, flags)
    encs = [tok.encode(t) for t in CORPUS]
    return {"file": path, "pre": pre, "flags": flags, "ids": [e.ids for e in encs],
            "text": [tok.decode(e.ids) for e in encs]}


def synthetic(out):
    vocab, merges = learn_vocab()
    cases = [case(out, f"pre-{i}", pre, vocab, merges, {})
             for i, pre in enumerate(p for names, _, _ in FAMILIES for p in names)]
    cases.append(case(out, "pre-absent", None, vocab, merges, {}))
    for i, (pre, flags) in enumerate(FLAG_CASES):
        cases.append(case(out, f"flags-{i}", pre, vocab, merges, flags))
    refused = {}
    for pre in ["kimi-k2", "gemma4", "no-such-pre"]:
        path = os.path.join(out, f"refused-{pre}.gguf")
        write_gguf(path, pre, vocab, merges, {})
        refused[pre] = path
    return {"texts": CORPUS, "cases": cases, "refused": refused}


def released(path):
    """The ids of a released file's own vocabulary and merges under its pre value's rules."""
    r = gguf.GGUFReader(path)
    field = lambda k: r.fields[k]
    strings = lambda k: [bytes(field(k).parts[i]).decode() for i in field(k).data]
    scalar = lambda k: field(k).parts[field(k).data[0]][0]
    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    types = [int(field("tokenizer.ggml.token_type").parts[i][0]) for i in field("tokenizer.ggml.token_type").data]
    pre = bytes(field("tokenizer.ggml.pre").parts[field("tokenizer.ggml.pre").data[0]]).decode()
    vocab = {t: i for i, t in enumerate(tokens)}
    steps, opts = family(pre)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                               ignore_merges=opts.get("ignore_merges", False)))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps())
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, normalized=True) for t, ty in zip(tokens, types) if ty == 4])
    add_bos = bool(scalar("tokenizer.ggml.add_bos_token")) if "tokenizer.ggml.add_bos_token" in r.fields \
        else opts.get("add_bos", False)
    assert not add_bos, "this reference adds no BOS"
    encs = [tok.encode(t) for t in CORPUS]
    return {"texts": CORPUS, "cases": [{"file": path, "pre": pre, "flags": {},
                                        "ids": [e.ids for e in encs],
                                        "text": [tok.decode(e.ids) for e in encs]}],
            "refused": {}}


def main():
    out = sys.argv[1]
    result = released(sys.argv[3]) if sys.argv[2:3] == ["--gguf"] else synthetic(out)
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

"""One-time check of wgpar's Phi-3 against Hugging Face transformers (not run by CI: it needs
torch and transformers, which the tests' requirements do not carry).

Usage: python phi3_transformers.py WGPAR_BINARY SCRATCH_DIR

Makes a tiny random Phi3ForCausalLM (3 layers, 8 heads of 16 over 128, 2 KV heads, fused
qkv_proj and gate_up_proj as transformers stores them, untied head), saves it with
save_pretrained, runs greedy decoding in transformers in float64 on the prompts `wgpar run`
makes itself (`--batch 2 --prompt-len 8`: ids (7919 b + 104729 i) mod vocab), then
`wgpar run --logits-out` on the saved folder on one device, tensor-parallel over 2 and as a
2-stage pipeline (virtual devices; f32 KV cache), and on one device with the default KV cache,
and prints per strategy whether the generated ids agree and the largest relative error of
wgpar's logits over every step.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import torch
from transformers import Phi3Config, Phi3ForCausalLM

VOCAB = 300
BATCH, PROMPT_LEN = 2, 8
GEN = 12
PROMPTS = [[(b * 7919 + i * 104_729) % VOCAB for i in range(PROMPT_LEN)] for b in range(BATCH)]
# An f32 KV cache, so only f32 arithmetic separates wgpar from float64; and the default cache
# (f16 where the adapter has SHADER_F16), which rounds every cached key and value.
F32_CACHE = ["--kv-dtype", "f32"]
STRATEGIES = {
    "single": F32_CACHE,
    "tp2": ["--strategy", "tp", "--virtual", "2"] + F32_CACHE,
    "pp2": ["--strategy", "pp", "--virtual", "2"] + F32_CACHE,
    "single, default KV cache": [],
}


def tiny_model():
    torch.manual_seed(1234)
    config = Phi3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
        original_max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        sliding_window=None,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    model = Phi3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
                continue
            bound = math.sqrt(3.0 / p.shape[-1])
            p.uniform_(-bound, bound)
    return model.float().eval()


def transformers_greedy(model):
    """Per prompt: the greedy ids, and each step's last-position logits, in float64."""
    model = model.double()
    result = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids, logits = list(prompt), []
            for _ in range(GEN):
                out = model(torch.tensor([ids])).logits[0, -1]
                logits.append(out.tolist())
                ids.append(int(torch.argmax(out)))
            result.append((ids[len(prompt):], logits))
    return result


def wgpar_greedy(binary, directory, strategy):
    out = directory / "wgpar.json"
    subprocess.run(
        [binary, "run", "--model", str(directory), "--batch", str(BATCH),
         "--prompt-len", str(PROMPT_LEN), "--gen", str(GEN), "--logits-out", str(out)]
        + STRATEGIES[strategy],
        check=True, capture_output=True,
    )
    return json.loads(out.read_text())


def compare(want, got):
    """(same ids, steps compared, largest relative error) of one wgpar run."""
    same = all(got["tokens"][b] == want[b][0] for b in range(BATCH))
    errors = []
    for step, row in enumerate(got["logits"]):
        for b in range(BATCH):
            g = row[b * VOCAB:(b + 1) * VOCAB]
            w = want[b][1][step]
            scale = max(abs(v) for v in w)
            errors.append(max(abs(x - y) for x, y in zip(g, w)) / scale)
    return same, len(got["logits"]), max(errors)


def main():
    binary, scratch = sys.argv[1], Path(sys.argv[2])
    scratch.mkdir(parents=True, exist_ok=True)
    model = tiny_model()
    model.save_pretrained(scratch, safe_serialization=True)
    want = transformers_greedy(model)
    report, ok = {"transformers_ids": [w[0] for w in want]}, True
    for strategy in STRATEGIES:
        same, steps, err = compare(want, wgpar_greedy(binary, scratch, strategy))
        report[strategy] = {"same_ids": same, "steps": steps, "max_relative_error": err}
        ok = ok and same and steps == GEN
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

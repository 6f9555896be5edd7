"""What the one-time transformers checks (`*_transformers.py`, not run by CI) share: the prompts
`wgpar run` makes itself, greedy decoding in transformers in float64, `wgpar run --logits-out`
on the saved folder per strategy, and the comparison of ids and logits.

A family's script makes its tiny random model and calls `main(tiny_model)`.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import torch

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



def init_uniform(model, norm_low, norm_high, scale=lambda name: 1.0):
    """Norm scales uniform in [norm_low, norm_high], every other parameter uniform within
    +-sqrt(3 / fan_in) times `scale(name)`, in float32 evaluation mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(norm_low, norm_high)
                continue
            bound = math.sqrt(3.0 / p.shape[-1]) * scale(name)
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


def wgpar_greedy(binary, directory, strategy, extra=()):
    out = directory / "wgpar.json"
    subprocess.run(
        [binary, "run", "--model", str(directory), "--batch", str(BATCH),
         "--prompt-len", str(PROMPT_LEN), "--gen", str(GEN), "--logits-out", str(out)]
        + STRATEGIES[strategy] + list(extra),
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


def main(tiny_model, wgpar_args=(), name=""):
    """Saves `tiny_model()` in SCRATCH_DIR (argv[2], under `name` if given), checks the wgpar
    binary (argv[1]) on it with `wgpar_args` added to each run and prints the report; 0 when
    every strategy gives the same ids."""
    binary, scratch = sys.argv[1], Path(sys.argv[2]) / name
    scratch.mkdir(parents=True, exist_ok=True)
    model = tiny_model()
    model.save_pretrained(scratch, safe_serialization=True)
    want = transformers_greedy(model)
    report, ok = {"transformers_ids": [w[0] for w in want]}, True
    for strategy in STRATEGIES:
        got = wgpar_greedy(binary, scratch, strategy, wgpar_args)
        same, steps, err = compare(want, got)
        report[strategy] = {"same_ids": same, "steps": steps, "max_relative_error": err}
        ok = ok and same and steps == GEN
    print(json.dumps(report))
    return 0 if ok else 1


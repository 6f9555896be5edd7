"""The `openai` package against `wgpar serve` for tests/serve_api.rs: log-probs through the
client's own types, chat and streamed completions.

Usage: client.py PORT COMMAND ARGS; prints JSON on stdout. Every wait is bounded.
"""
import json
import sys

import openai


def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                         timeout=120.0, max_retries=0)


def chat_logprobs(port, content, top):
    """A greedy chat answer with `logprobs` and `top_logprobs`: each token's entry."""
    r = client(port).chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=int(top), extra_body={"ignore_eos": True})
    entries = [{"token": e.token, "logprob": e.logprob,
                "top": [[t.token, t.logprob] for t in e.top_logprobs]}
               for e in r.choices[0].logprobs.content]
    return {"text": r.choices[0].message.content, "entries": entries}


def stream_logprobs(port, prompt, top):
    """A streamed greedy completion with `logprobs`: the chunks' entries joined, and the
    same request unstreamed."""
    c = client(port)
    args = dict(model="m", prompt=prompt, max_tokens=5, temperature=0, logprobs=int(top),
                extra_body={"ignore_eos": True})
    whole = c.completions.create(**args).choices[0]
    tokens, lps, tops, text = [], [], [], ""
    for chunk in c.completions.create(stream=True, **args):
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                lps += ch.logprobs.token_logprobs
                tops += ch.logprobs.top_logprobs
    return {"stream": {"text": text, "tokens": tokens, "logprobs": lps, "top": tops},
            "whole": {"text": whole.text, "tokens": whole.logprobs.tokens,
                      "logprobs": whole.logprobs.token_logprobs,
                      "top": whole.logprobs.top_logprobs}}


def refused(port, field, value):
    """A request with `field`: the error's status and `param`, as the client reports them."""
    try:
        client(port).completions.create(model="m", prompt="t1", max_tokens=1,
                                        extra_body={field: json.loads(value)})
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        body = body.get("error", body)
        return {"status": e.status_code, "param": body.get("param")}
    return {"status": 200, "param": None}


if __name__ == "__main__":
    port, command, *args = sys.argv[1:]
    print(json.dumps(globals()[command](port, *args)))

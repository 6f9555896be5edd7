"""Clients of `wgpar serve` for tests/serve_http.rs: the `openai` package and jinja2.

Usage: client.py PORT COMMAND [ARGS]; prints JSON on stdout. Every wait is bounded.
"""
import json
import sys
import threading
import urllib.error
import urllib.request

import jinja2
import openai


def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                         timeout=120.0, max_retries=0)


def complete(port, prompt, max_tokens, stop=None):
    """One non-streamed and one streamed greedy completion of prompt (ended by `stop`, a
    list of strings, if given)."""
    c = client(port)
    whole = c.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                 stop=stop)
    parts, usage, finish = [], None, None
    for chunk in c.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                      temperature=0, stop=stop, stream=True,
                                      stream_options={"include_usage": True}):
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage.model_dump()
    return {"text": whole.choices[0].text, "finish": whole.choices[0].finish_reason,
            "usage": whole.usage.model_dump(), "stream_text": "".join(parts),
            "stream_finish": finish, "stream_usage": usage, "chunks": len(parts)}


def concurrent(port, prompts, max_tokens, sampling=None):
    """Each prompt alone (non-streamed), then all at once as streams. `sampling(i)` gives
    request i's sampling fields (greedy when None)."""
    c = client(port)
    fields = sampling or (lambda i: {"temperature": 0})
    alone = [c.completions.create(model="m", prompt=p, max_tokens=max_tokens,
                                  **fields(i)).choices[0].text
             for i, p in enumerate(prompts)]
    results = [None] * len(prompts)

    def one(i):
        try:
            parts, usage = [], None
            for chunk in client(port).completions.create(
                    model="m", prompt=prompts[i], max_tokens=max_tokens, stream=True,
                    stream_options={"include_usage": True}, **fields(i)):
                if chunk.choices:
                    parts.append(chunk.choices[0].text)
                if chunk.usage:
                    usage = chunk.usage.model_dump()
            results[i] = {"text": "".join(parts), "usage": usage}
        except Exception as e:  # reported, compared by the test
            results[i] = {"error": repr(e)}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return {"alone": alone, "together": results}


def sampled(port, prompts, max_tokens, temperature, top_p):
    """`concurrent` with sampling: request i has seed 100 + i, and odd requests are greedy
    so sampled and greedy rows share steps. Then request 0 once more with another seed."""
    def fields(i):
        if i % 2 == 1:
            return {"temperature": 0}
        return {"temperature": temperature, "top_p": top_p, "seed": 100 + i}
    out = concurrent(port, prompts, max_tokens, fields)
    out["reseeded"] = client(port).completions.create(
        model="m", prompt=prompts[0], max_tokens=max_tokens, temperature=temperature,
        top_p=top_p, seed=7).choices[0].text
    return out


def cancel(port, count, prompt):
    """Starts `count` long streams, reads one chunk of each, and drops them. Each asks for
    nearly the whole context and ignores the end token, so that none can finish on its own
    before it is dropped (a short one could, on a fast adapter, and then count as done)."""
    c = client(port)
    streams = [c.completions.create(model="m", prompt=prompt, max_tokens=90, stream=True,
                                    extra_body={"ignore_eos": True})
               for _ in range(count)]
    firsts = [next(iter(s)).choices[0].text for s in streams]
    for s in streams:
        s.close()
    return {"firsts": firsts}


def flood(port, count, prompt):
    """`count` requests at once over plain HTTP: each one's status and Retry-After."""
    out = [None] * count

    def one(i):
        body = json.dumps({"prompt": prompt, "max_tokens": 40}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                out[i] = {"status": r.status}
        except urllib.error.HTTPError as e:
            out[i] = {"status": e.code, "retry_after": e.headers.get("Retry-After")}
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def streams_until_error(port, count, prompt):
    """`count` streams at once; how each ended (text, or the error the server sent)."""
    out = [None] * count

    def one(i):
        try:
            parts = []
            for chunk in client(port).completions.create(model="m", prompt=prompt,
                                                         max_tokens=30, stream=True):
                if chunk.choices:
                    parts.append(chunk.choices[0].text)
            out[i] = {"text": "".join(parts)}
        except Exception as e:
            out[i] = {"error": repr(e)}
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def render(template_file, messages_json, bos, eos):
    """The chat prompt as Hugging Face renders it (jinja2, trim_blocks, lstrip_blocks)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(open(template_file).read())
    return {"prompt": template.render(messages=json.loads(messages_json),
                                      add_generation_prompt=True, bos_token=bos, eos_token=eos)}


def chat(port, messages_json, max_tokens):
    r = client(port).chat.completions.create(model="m", messages=json.loads(messages_json),
                                             max_tokens=max_tokens, temperature=0)
    return {"text": r.choices[0].message.content, "usage": r.usage.model_dump()}


def main():
    port, command, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    if command == "complete":
        stop = json.loads(args[2]) if len(args) > 2 else None
        out = complete(port, args[0], int(args[1]), stop)
    elif command == "concurrent":
        out = concurrent(port, json.loads(args[0]), int(args[1]))
    elif command == "sampled":
        out = sampled(port, json.loads(args[0]), int(args[1]), float(args[2]), float(args[3]))
    elif command == "cancel":
        out = cancel(port, int(args[0]), args[1])
    elif command == "flood":
        out = flood(port, int(args[0]), args[1])
    elif command == "streams":
        out = streams_until_error(port, int(args[0]), args[1])
    elif command == "render":
        out = render(*args)
    elif command == "chat":
        out = chat(port, args[0], int(args[1]))
    else:
        raise SystemExit(f"unknown command {command}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""The `openai` package against `wgpar serve` for tests/serve_tools.rs and
tests/serve_embeddings.rs: tool calls through the client's own types (whole and streamed),
embeddings through `embeddings.create`, and the reference rendering of a chat template with
tools by jinja2 as Hugging Face sets it up.

Usage: client.py COMMAND ARGS; prints JSON on stdout. Every wait is bounded.
"""
import json
import sys

import jinja2
import jsonschema
import openai


def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                         timeout=120.0, max_retries=0)


# Fields of vLLM's the client has no argument for: sent in `extra_body`.
EXTRA = {"allowed_token_ids", "repetition_penalty", "ignore_eos", "top_k", "min_tokens"}


def request(body_json):
    body = json.loads(body_json)
    extra = {k: body.pop(k) for k in list(body) if k in EXTRA}
    if extra:
        body["extra_body"] = extra
    return body


def render(template_file, messages_json, tools_json):
    """The prompt as Hugging Face renders it: jinja2 with trim_blocks and lstrip_blocks, its
    `tojson` (json.dumps, ensure_ascii=False), `tools` passed (None without), and assistant
    tool-call arguments read from their JSON text into objects, as vLLM does before rendering."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, sort_keys=sort_keys)
    messages = json.loads(messages_json)
    for m in messages:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if m.get("content") is None:
            m["content"] = ""
    tools = json.loads(tools_json)
    template = env.from_string(open(template_file).read())
    return {"prompt": template.render(messages=messages, tools=tools or None,
                                      add_generation_prompt=True, bos_token="", eos_token="")}


def call(port, body_json):
    """One chat answer: its content, finish reason and tool calls as the client parsed them."""
    r = client(port).chat.completions.create(**request(body_json))
    choice = r.choices[0]
    calls = [{"id": c.id, "type": c.type, "name": c.function.name,
              "arguments": json.loads(c.function.arguments), "raw": c.function.arguments}
             for c in (choice.message.tool_calls or [])]
    return {"content": choice.message.content, "finish": choice.finish_reason, "calls": calls}


def stream(port, body_json):
    """The same, streamed: content deltas joined, tool-call deltas merged by index as a client
    does (id, type and name from the first delta of a call, arguments appended)."""
    content, finish, calls, chunks = "", None, {}, 0
    try:
        for chunk in client(port).chat.completions.create(stream=True, **request(body_json)):
            merge(chunk, calls)
            for ch in chunk.choices:
                content += ch.delta.content or ""
                finish = ch.finish_reason or finish
                chunks += len(ch.delta.tool_calls or [])
    except openai.APIError as e:
        # The stream ended in an error event: what came before it, and the error.
        return {"content": content, "error": e.message, "calls_begun": len(calls)}
    listed = [dict(c, arguments=json.loads(c["arguments"]), raw=c["arguments"])
              for _, c in sorted(calls.items())]
    return {"content": content, "finish": finish, "calls": listed, "tool_chunks": chunks}


def merge(chunk, calls):
    """One chunk's tool-call deltas merged into `calls` by index."""
    for ch in chunk.choices:
        for d in ch.delta.tool_calls or []:
            # Each delta carries either the name or arguments, not both.
            assert (d.function.name is None) != (not d.function.arguments), d
            c = calls.setdefault(d.index, {"id": None, "type": None, "name": "",
                                           "arguments": ""})
            c["id"] = d.id or c["id"]
            c["type"] = d.type or c["type"]
            if d.function is not None:
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""


def accumulate(port, body_json):
    """Streamed through the client's own accumulation (`chat.completions.stream`): the calls
    of its final completion (arguments as text), and the argument pieces each call got."""
    pieces = {}
    with client(port).chat.completions.stream(**request(body_json)) as s:
        for event in s:
            if event.type == "tool_calls.function.arguments.delta" and event.arguments_delta:
                pieces[event.index] = pieces.get(event.index, 0) + 1
        final = s.get_final_completion()
    choice = final.choices[0]
    calls = [{"id": c.id, "name": c.function.name, "raw": c.function.arguments}
             for c in (choice.message.tool_calls or [])]
    return {"content": choice.message.content, "finish": choice.finish_reason, "calls": calls,
            "pieces": [pieces.get(k, 0) for k in range(len(calls))]}


def refused(port, body_json):
    """A request the server should refuse: the status and `param` the client reports."""
    try:
        client(port).chat.completions.create(**request(body_json))
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        body = body.get("error", body)
        return {"status": e.status_code, "param": body.get("param")}
    return {"status": 200, "param": None}


def forced(port, body_json, mode):
    """A forced `tool_choice` (`required` or a named function), whole (`call`) or streamed
    (`stream`): the answer, each call's arguments validated by jsonschema against its
    function's parameters (`valid`, else `error`)."""
    tools = json.loads(body_json)["tools"]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    out = {"call": call, "stream": stream}[mode](port, body_json)
    for c in out["calls"]:
        try:
            jsonschema.validate(c["arguments"], params[c["name"]])
            c["valid"] = True
        except (KeyError, jsonschema.ValidationError) as e:
            c["valid"] = False
            c["error"] = str(e)[:300]
    return out


def embed(port, input_json, encoding):
    """embeddings.create: `float`, or the client's default (it asks for base64 and decodes)."""
    args = dict(model="m", input=json.loads(input_json))
    if encoding != "default":
        args["encoding_format"] = encoding
    r = client(port).embeddings.create(**args)
    return {"data": [[float(x) for x in d.embedding] for d in r.data],
            "index": [d.index for d in r.data],
            "usage": [r.usage.prompt_tokens, r.usage.total_tokens], "model": r.model}


def main():
    command, args = sys.argv[1], sys.argv[2:]
    out = {"render": render, "call": call, "stream": stream, "accumulate": accumulate,
           "refused": refused,
           "forced": forced, "embed": embed}[command](*args)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

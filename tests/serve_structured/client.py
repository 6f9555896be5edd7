"""The `openai` package against `wgpar serve` for tests/serve_structured.rs: structured output
(`response_format`) on chat and completions, several requests at once, each answer checked
against its schema with `jsonschema`.

Usage: client.py PORT CASES MAX_TOKENS; CASES is `smol` (questions for an instruct model) or
`bytes` (prompts for a random model with a byte vocabulary). Prints a JSON list, one entry per
request: its case, route, finish reason, text, and whether the text parses and validates (with
the validator's message when not). Every wait is bounded.
"""
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

CITY = {
    "type": "object",
    "properties": {
        "city": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "country": {"type": "string", "maxLength": 24},
            },
            "required": ["name", "country"],
            "additionalProperties": False,
        },
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
COLOR = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "sure": {"type": "boolean"},
    },
    "required": ["color", "sure"],
    "additionalProperties": False,
}
FRUITS = {
    "type": "object",
    "properties": {
        "fruits": {"type": "array", "items": {"type": "string", "maxLength": 16},
                   "minItems": 1, "maxItems": 3},
    },
    "required": ["fruits"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "temperature": {"type": "number", "minimum": -50, "maximum": 60},
        "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["temperature", "humidity"],
    "additionalProperties": False,
}
# A random model writes whatever the mask leaves: every string and list is bounded.
SMALL = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["a", "bb", "ccc"]},
        "n": {"type": "integer", "minimum": -9, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 1},
        "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                  "required": ["ok"], "additionalProperties": False},
    },
    "required": ["kind", "n", "tags", "inner"],
    "additionalProperties": False,
}
NUMBERS = {
    "type": "object",
    "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
               "minItems": 1, "maxItems": 3},
        "flag": {"type": "boolean"},
    },
    "required": ["xs", "flag"],
    "additionalProperties": False,
}
ANY_OBJECT = {"type": "object"}

SMOL = [
    ("city", "chat", CITY, "Give the capital of France, its country and its population as JSON."),
    ("color", "chat", COLOR, "What colour is the sky on a clear day? Answer in JSON."),
    ("fruits", "chat", FRUITS, "List two fruits as JSON."),
    ("weather", "chat", WEATHER, "Describe a warm humid day as JSON."),
    ("object", "chat", None, "Reply with a JSON object whose key \"answer\" holds yes or no. "
                             "Is water wet?"),
    ("color", "text", COLOR, "The colour of grass, as JSON: "),
    ("weather", "text", WEATHER, "Today's weather as JSON: "),
]
BYTES = [
    ("small", "chat", SMALL, "hi"),
    ("small", "text", SMALL, "abc"),
    ("color", "chat", COLOR, "xyz"),
    ("numbers", "text", NUMBERS, "q"),
]


def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                         timeout=600.0, max_retries=0)


def response_format(schema, name):
    if schema is None:
        return {"type": "json_object"}
    return {"type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True}}


def ask(port, case, max_tokens):
    name, route, schema, prompt = case
    c = client(port)
    rf = response_format(schema, name)
    if route == "chat":
        r = c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0, response_format=rf)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    else:
        r = c.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                 temperature=0, extra_body={"response_format": rf})
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    entry = {"case": name, "route": route, "finish": finish, "text": text, "valid": False}
    try:
        value = json.loads(text)
        jsonschema.validate(value, schema if schema is not None else ANY_OBJECT)
        entry["valid"] = True
    except (ValueError, jsonschema.ValidationError) as e:
        entry["error"] = str(e)[:300]
    return entry


def main():
    port, cases, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cases = {"smol": SMOL, "bytes": BYTES}[cases]
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        results = list(pool.map(lambda case: ask(port, case, max_tokens), cases))
    print(json.dumps(results))


if __name__ == "__main__":
    main()

"""The `openai` reference client against a kvmesh deployment, for the end-to-end tests.

usage: openai_client.py BASE_URL MODE PROMPT   (MODE: chat | stream)
Prints one JSON object: the engine that answered (x-kvmesh-engine), the text, and usage.
"""
import json
import sys

from openai import OpenAI

base, mode, prompt = sys.argv[1], sys.argv[2], sys.argv[3]
client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
messages = [{"role": "user", "content": prompt}]
if mode == "chat":
    raw = client.chat.completions.with_raw_response.create(
        model="sim-model", messages=messages, max_tokens=4
    )
    r = raw.parse()
    out = {
        "engine": raw.headers.get("x-kvmesh-engine"),
        "text": r.choices[0].message.content,
        "chunks": 1,
        "usage": r.usage.model_dump() if r.usage else None,
    }
elif mode == "stream":
    raw = client.chat.completions.with_raw_response.create(
        model="sim-model",
        messages=messages,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage.model_dump()
    out = {
        "engine": raw.headers.get("x-kvmesh-engine"),
        "text": "".join(pieces),
        "chunks": len(pieces),
        "usage": usage,
    }
else:
    sys.exit(f"unknown mode {mode!r}")
print(json.dumps(out))

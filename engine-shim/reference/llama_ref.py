#!/usr/bin/env python3
"""Independent f32 reference for engine-shim's forward pass (test instrument).

Reads the GGUF with the `gguf` package (its own dequantisation), runs the Llama forward pass in
numpy for the given token ids, and writes the logits of every position as little-endian f32 to
OUT. Usage: llama_ref.py MODEL.gguf OUT.bin TOKEN_ID...
"""
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main():
    path, out, ids = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3:]]
    r = GGUFReader(path)

    def meta(key):
        f = r.fields[key]
        return f.parts[f.data[0]][0]

    n_layer = int(meta("llama.block_count"))
    n_head = int(meta("llama.attention.head_count"))
    n_kv = int(meta("llama.attention.head_count_kv"))
    base = float(meta("llama.rope.freq_base"))
    eps = float(meta("llama.attention.layer_norm_rms_epsilon"))
    W = {}
    for t in r.tensors:
        W[t.name] = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(
            [int(d) for d in reversed(t.shape.tolist())])
    emb = W["token_embd.weight"]
    d = emb.shape[1]
    hd = d // n_head
    T = len(ids)
    x = emb[ids]

    def norm(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w

    pos = np.arange(T, dtype=np.float64)[:, None]
    inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = pos * inv[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def rope(v):  # v: [T, H, hd], pairs (2i, 2i+1)
        a, b = v[..., 0::2], v[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        outv = np.empty_like(v)
        outv[..., 0::2] = a * c - b * s
        outv[..., 1::2] = a * s + b * c
        return outv

    mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    for i in range(n_layer):
        g = lambda n: W[f"blk.{i}.{n}.weight"]
        h = norm(x, g("attn_norm"))
        q = rope((h @ g("attn_q").T).reshape(T, n_head, hd))
        k = rope((h @ g("attn_k").T).reshape(T, n_kv, hd))
        v = (h @ g("attn_v").T).reshape(T, n_kv, hd)
        rep = n_head // n_kv
        att = np.empty((T, n_head, hd), dtype=np.float32)
        for hh in range(n_head):
            kk, vv = k[:, hh // rep], v[:, hh // rep]
            s = q[:, hh] @ kk.T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            att[:, hh] = s @ vv
        x = x + att.reshape(T, d) @ g("attn_output").T
        h = norm(x, g("ffn_norm"))
        gate = h @ g("ffn_gate").T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ g("ffn_up").T)) @ g("ffn_down").T
    out_w = W.get("output.weight", emb)
    logits = norm(x, W["output_norm.weight"]) @ out_w.T
    logits.astype("<f4").tofile(out)


if __name__ == "__main__":
    main()

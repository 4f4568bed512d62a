#!/usr/bin/env python3
"""Plots a `kvmesh-bench compare` result: TTFT CDF per target (one panel per cache capacity)
and token hit ratio per target (grouped by capacity, with the oracle). Needs matplotlib.

usage: plot_bench.py RESULT.json OUT_DIR
"""
import json
import os
import sys
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        data = json.load(f)
    out = sys.argv[2]
    os.makedirs(out, exist_ok=True)
    base = os.path.splitext(os.path.basename(sys.argv[1]))[0]
    results = data["results"]
    caps = sorted({r["cache_blocks"] for r in results})
    targets = list(dict.fromkeys(r["target"] for r in results))

    fig, axes = plt.subplots(1, len(caps), figsize=(5.5 * len(caps), 4.2), squeeze=False)
    for ax, cap in zip(axes[0], caps):
        for r in (r for r in results if r["cache_blocks"] == cap):
            xs = r["ttft_ms"]
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.plot(xs, ys, label=r["target"], linewidth=1.4)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"TTFT CDF, cache {cap} blocks/replica")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("\n".join(textwrap.wrap(data.get("workload", ""), 110)), fontsize=8)
    fig.tight_layout()
    ttft_png = os.path.join(out, f"{base}-ttft-cdf.png")
    fig.savefig(ttft_png, dpi=110)

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(targets) + 2), 4.2))
    width = 0.8 / max(1, len(caps))
    for j, cap in enumerate(caps):
        vals = []
        for t in targets:
            hit = [r["summary"]["hit_ratio"] for r in results if r["cache_blocks"] == cap and r["target"] == t]
            vals.append(hit[0] if hit else 0.0)
        xs = [i + (j - (len(caps) - 1) / 2) * width for i in range(len(targets))]
        ax.bar(xs, vals, width=width, label=f"cache {cap}")
    ax.axhline(data["oracle_hit_ratio"], color="black", linestyle="--", linewidth=1, label="oracle (infinite cache)")
    ax.set_xticks(range(len(targets)))
    ax.set_xticklabels(targets, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("token hit ratio (cached / prompt)")
    ax.set_title("prefix-cache hit ratio per router")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    hit_png = os.path.join(out, f"{base}-hit-ratio.png")
    fig.savefig(hit_png, dpi=110)
    print(f"wrote {ttft_png} and {hit_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

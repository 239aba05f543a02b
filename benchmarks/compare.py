"""Before/after of two ``benchmarks.decode`` records (``<tag>.json``): per method the geo-mean of the time ratio
(after / before) over the configs both timed, the slowest-moving row, and the serving shapes' rows; the ratios of
times, not of speedups, so a baseline's own run-to-run drift does not move a method's number.

    python -m benchmarks.compare benchmarks/results/decode-...-before.json benchmarks/results/decode-...-after.json
"""

from __future__ import annotations

import argparse
import json
import math

from benchmarks.decode import SERVING

__all__ = ["compare", "main"]


def _times(record) -> dict:
    rows = record["rows"] if isinstance(record, dict) else record
    return {(r["model"], r["batch"], r["context"], r["method"]): r["us"] for r in rows if r.get("us")}


def compare(before, after) -> str:
    """The markdown comparison of two decode records (loaded JSON)."""
    b, a = _times(before), _times(after)
    common = [k for k in b if k in a]
    methods = list(dict.fromkeys(k[3] for k in common))
    lines = ["| method | geo-mean after / before | slowest row | configs |", "|---|---|---|---|"]
    for m in methods:
        ratios = {k: a[k] / b[k] for k in common if k[3] == m}
        geo = math.exp(sum(math.log(x) for x in ratios.values()) / len(ratios))
        worst = max(ratios, key=ratios.get)
        lines.append(f"| {m} | {geo:.4f} | {ratios[worst]:.3f} ({worst[0]} {worst[1]} x {worst[2]}) | {len(ratios)} |")
    serving = [s for s in SERVING if any(k[:3] == s for k in common)]
    if serving:
        lines += ["", "Serving shapes (us, before -> after):", "",
                  "| shape | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
        for s in serving:
            cells = [f"{b[k]:.1f} -> {a[k]:.1f} ({a[k] / b[k] - 1:+.1%})" if (k := (*s, m)) in b and k in a else "-"
                     for m in methods]
            lines.append(f"| {s[0]} {s[1]} x {s[2]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args(argv)
    with open(args.before) as f, open(args.after) as g:
        print(compare(json.load(f), json.load(g)), end="")


if __name__ == "__main__":
    main()

"""Decode over batches of unequal lengths (what a serving batch is): FOSCAR ``PagedKVCache.attend``
(BF16 sink 64 + window 256, one launch) side by side with FlashInfer BF16 on the same lengths
(FlashInfer plans each batch on the host from its lengths), in one process. FlashInfer is the ``bench``
extra: ``pip install -e '.[bench]'``.

    python -m benchmarks.ragged [--out benchmarks/results] [--tag ragged]

Timing as ``benchmarks.decode`` (CUDA graph over >= 4x L2 of distinct layers, median of replays).
Qwen3-8B attention geometry (32 query heads, 8 KV heads, head_dim 128). The mixes: one long sequence
among short ones, a few long among many short, 32 lengths log-uniform over 1K-64K, and an equal-length
control (the standard sweep's 8 x 32K)."""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

from .decode import (MODELS, FlashInferDecode, _versions, copies_for, foscar_window_layers, import_flashinfer,
                     time_layers)
from .records import run_meta, write


def mixes():
    rnd = random.Random(12)
    return {
        "1 x 128K + 7 x 4K": [131072] + [4096] * 7,
        "4 x 32K + 60 x 1K": [32768] * 4 + [1024] * 60,
        "32 log-uniform 1K-64K": [int(2 ** rnd.uniform(10, 16)) for _ in range(32)],
        "8 x 32K (equal)": [32768] * 8,
    }


VARIANTS = (("int2-kt", 2, "token"), ("int4-kt", 4, "token"), ("int2-kc", 2, "channel"))


def main(argv=None):
    from foscar import Scheme

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--tag", default="ragged")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--mixes", default="", help="only the mixes whose names contain this text")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks.ragged needs a CUDA GPU")
    try:  # its baseline, before any timing
        import_flashinfer()
    except ImportError as exc:
        sys.exit(f"benchmarks.ragged needs FlashInfer: {exc}")
    q_heads, kv_heads, head_dim = MODELS["qwen3-8b"]
    rows = []
    for name, lengths in [(n, ls) for n, ls in mixes().items() if args.mixes in n]:
        fi = FlashInferDecode(len(lengths), 0, q_heads, kv_heads, head_dim, torch.bfloat16, lengths=lengths)
        copies = copies_for(fi.nbytes)
        caches = [fi.cache] + [fi.cache.clone() for _ in range(copies - 1)]
        row = {"mix": name, "batch": len(lengths), "tokens": sum(lengths), "max": max(lengths),
               "flashinfer-bf16": time_layers([lambda c=c, f=fi: f(c) for c in caches], args.reps)}
        del fi, caches
        for label, bits, k_axis in VARIANTS:
            scheme = Scheme.make(bits, k_axis, 128, "token", 128, head_dim, q_heads // kv_heads)
            fns, _, _ = foscar_window_layers(scheme, len(lengths), max(lengths), kv_heads, lengths=lengths)
            row[label + "+sw"] = time_layers(fns, args.reps)
            del fns
            torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
    meta = run_meta("benchmarks.ragged", argv, _versions())
    heads = " | ".join(f"{v[0]}+sw us (x)" for v in VARIANTS)
    lines = [f"| mix | batch | tokens | FlashInfer BF16 us | {heads} |",
             "|---|---|---|---|" + "---|" * len(VARIANTS)]
    for r in rows:
        base = r["flashinfer-bf16"]
        cells = " | ".join(f"{r[v[0] + '+sw']:.1f} ({base / r[v[0] + '+sw']:.2f}x)" for v in VARIANTS)
        lines.append(f"| {r['mix']} | {r['batch']} | {r['tokens']} | {base:.1f} | {cells} |")
    table = "\n".join(lines)
    write(args.out, args.tag, "Ragged decode batches", meta, rows, table)
    print(table)


if __name__ == "__main__":
    main()

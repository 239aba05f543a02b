"""Speculative verification: ``PagedKVCache.attend`` of several query tokens per sequence (the draft tokens,
appended to the 16-bit window first) against the same decode with one, in one process; with ``--path paged``,
``decode_paged`` over pages that hold every token (the draft quantized with them: the packed tiles carry the
causal mask; more tokens than one launch takes run as several launches).

    python -m benchmarks.verify [--tokens 1,2,4] [--methods int2-kt128,int4-kt128] [--rollback 0] [--path cache]

The pages are read once whatever the token count (the query tile takes gqa x tokens columns), so the target
is a verification of 4 tokens costing at most 1.3x a single-token decode (issue 25). ``--rollback k`` builds the
caches with that margin, so that up to ``k`` tokens more than one launch takes run as earlier launches. Timing as
``benchmarks.decode``: one CUDA graph over enough cache copies to keep L2 out, median of replays.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

from .decode import MODELS, _versions, foscar_layers, foscar_window_layers, scheme_of, time_layers
from .records import run_meta, write

SHAPES = [("qwen3-8b", 8, 32768), ("qwen3-8b", 1, 131072), ("qwen3-8b", 64, 8192), ("tp4-70b", 1, 131072)]


def measure(methods, tokens_list, reps, rollback=0, path="cache"):
    """Rows ``(model, batch, context, method, tokens, us, ratio to one token)``; a count the cache cannot take
    (past one launch and its rollback margin; ``decode_paged`` takes any) is a row with its reason."""
    rows = []
    for model, batch, context in SHAPES:
        hq, kvh, d = MODELS[model]
        for method in methods:
            scheme = dataclasses.replace(scheme_of(method), head_dim=d, gqa_ratio=hq // kvh)
            base = None
            for tokens in tokens_list:
                try:
                    if path == "cache":
                        fns = foscar_window_layers(scheme, batch, context, kvh, tokens=tokens, rollback=rollback)[0]
                    else:
                        fns = foscar_layers(scheme, batch, context, kvh, tokens=tokens)[0]
                    us = time_layers(fns, reps)
                except ValueError as err:  # the kernel's limit (attend raises before anything launches)
                    rows.append((model, batch, context, method, tokens, None, None, str(err)))
                    continue
                finally:
                    fns = None
                    torch.cuda.empty_cache()
                base = us if tokens == 1 else base
                rows.append((model, batch, context, method, tokens, us, us / base if base else None, ""))
                print(f"{model} {batch}x{context} {method} tokens={tokens}: {us:.1f} us", flush=True)
    return rows


def table(rows):
    lines = ["| model | batch | context | method | query tokens | us | vs 1 token | note |", "|---|---|---|---|---|---|---|---|"]
    for model, batch, context, method, tokens, us, ratio, note in rows:
        lines.append(f"| {model} | {batch} | {context} | {method} | {tokens} | {'-' if us is None else f'{us:.1f}'} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} | {note} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,2,4", help="query tokens per sequence (1 first: the reference)")
    parser.add_argument("--methods", default="int2-kt128,int2-kc128,int4-kt128")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rollback", type=int, default=0, help="the caches' rollback margin (tokens)")
    parser.add_argument("--path", choices=("cache", "paged"), default="cache",
                        help="PagedKVCache.attend (sink + window) or decode_paged (every token packed)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--tag", default="verify")
    args = parser.parse_args(argv)
    tokens_list = [int(t) for t in args.tokens.split(",")]
    if tokens_list[0] != 1 or any(t < 1 for t in tokens_list):
        parser.error(f"--tokens must start with 1 (the single-token reference), got {args.tokens!r}")
    if args.rollback < 0:
        parser.error(f"--rollback must be >= 0, got {args.rollback}")
    if args.rollback and args.path == "paged":
        parser.error("--rollback is the cache's margin: --path paged has none (it takes any token count)")
    methods = args.methods.split(",")
    for method in methods:
        if scheme_of(method) is None or method.endswith("+sw"):
            parser.error(f"--methods: {method!r} is not <format>-k<t|c><group> (the cache decode: sink + window)")
    if not torch.cuda.is_available():
        sys.exit("benchmarks.verify needs a CUDA GPU")
    rows = measure(methods, tokens_list, args.reps, args.rollback, args.path)
    meta = run_meta("benchmarks.verify", argv, _versions(), rollback=args.rollback, path=args.path)
    text = table(rows)
    setup = (f"cache: sink 64 + window 256, page 128, rollback {args.rollback}" if args.path == "cache" else
             "decode_paged: every token packed, page 128")
    write(args.out, args.tag, "Speculative verification", meta, rows, text,
          f"CUDA graph, median of {args.reps} replays; {setup}. ")
    print(text)

if __name__ == "__main__":
    main()

"""Where a few-KV-head batch-1 decode spends its time: the Hopper decode launch timed over split counts and consumer
warpgroups, next to the combine kernel that merges its splits, alone.

    python -m benchmarks.split_probe --models tp8-70b,tp4-70b --context 131072 --splits 32,64,96,128 --consumers 1,2,3
    python -m benchmarks.split_probe --models tp8-70b --splits 128,256 --consumers 2 --ctas-per-sm 1,2

A batch-1 sequence with one or two KV heads fills the GPU only through its splits (``foscar.work_list.plan_splits``
picks at most ``MAX_DECODE_SPLITS``): each CTA then attends a few tiles per consumer warp, and what does not shrink with the
tiles (the CTA's prologue and first ring fill, the warps' merge, the combine launch) sets the time. Each row is
checked against float64 first, into NaN-poisoned outputs (``foscar.testing.check_output``); times are medians of
CUDA-graph replays over L2-cold cache copies (``benchmarks.decode.time_layers``), in microseconds per layer. The
combine alone replays one set of partials (L2-warm, as after the decode that wrote them).
"""

from __future__ import annotations

import argparse

import torch

from foscar import Scheme
from foscar.decode import plan_splits
from foscar.hopper.decode import KERNELS
from foscar.kernels.combine import combine_splits
from foscar.layouts.fragment import TILE_TOKENS
from foscar.pipeline import split_range
from foscar.testing import check_output, random_problem

from .decode import MODELS, clones, copies_for, time_layers

PAGE = 128


def probe(model: str, batch: int, context: int, splits: list[int], consumers: list[int], reps: int,
          ctas_per_sm: tuple[int, ...] = (1,)) -> list[dict]:
    q_heads, kv_heads, d = MODELS[model]
    scheme = Scheme.make(2, "token", 128, "token", 128, d, q_heads // kv_heads)
    q, cache = random_problem(scheme, [context] * batch, kv_heads=kv_heads, page_size=PAGE, shuffle=False)
    sm_scale = d**-0.5
    sets = clones(cache, copies_for(cache.nbytes()))

    def call(c, n, wgs, ctas, out=None, lse=None):
        return KERNELS.run_decode(q, c.k_codes, c.k_params, c.v_codes, c.v_params, c.page_table, c.lengths,
                                  sm_scale, scheme, n, out, lse, consumers=wgs, ctas_per_sm=ctas)

    planned = plan_splits(batch, kv_heads, cache.max_tokens, torch.cuda.get_device_properties(0).multi_processor_count)
    print(f"{model} {batch}x{context}: plan_splits {planned}, "
          f"{KERNELS.launch_options(scheme, 1, cache.max_tokens, planned)}", flush=True)
    rows = []
    for n in splits:
        rows_per_seq = q.shape[1]
        o_part = torch.randn(batch, rows_per_seq, n, d, device="cuda")
        lse_part = torch.randn(batch, rows_per_seq, n, device="cuda")
        out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], device="cuda")
        merge = [lambda: combine_splits(o_part, lse_part, out, lse)] * len(sets)
        combine_us = time_layers(merge, reps) if n > 1 else 0.0
        # two CTAs per SM take one consumer warpgroup each (foscar.hopper.decode's options)
        for wgs, ctas in [(w, 1) for w in consumers if 1 in ctas_per_sm] + [(1, 2)] * (2 in ctas_per_sm):
            poisoned = torch.full_like(q, float("nan")), torch.full(q.shape[:-1], float("nan"), device="cuda")
            acc = check_output(*call(cache, n, wgs, ctas, *poisoned), q, cache, sm_scale)
            if not acc.ok:
                raise SystemExit(f"{model} {batch}x{context} splits={n} consumers={wgs} ctas_per_sm={ctas}: {acc}")
            us = time_layers([lambda c=c: call(c, n, wgs, ctas) for c in sets], reps)
            _, first, end = split_range(context, 0, n, 1)  # the first split's tiles: the longest
            rows.append({"model": model, "shape": f"{batch}x{context}", "splits": n, "consumers": wgs,
                         "ctas_per_sm": ctas, "tokens_per_cta": (end - first) * TILE_TOKENS, "decode_us": us,
                         "combine_us": combine_us})
            print(rows[-1], flush=True)
    return rows


def table(rows) -> str:
    lines = ["| model | shape | splits | tokens per CTA (at most) | consumer warpgroups | CTAs per SM "
             "| decode + combine (us) | combine alone (us) |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['shape']} | {r['splits']} | {r['tokens_per_cta']} | {r['consumers']} | "
              f"{r['ctas_per_sm']} | "
              f"{r['decode_us']:.1f} | {r['combine_us']:.1f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tp8-70b,tp4-70b", help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--splits", default="32,64,96,128")
    parser.add_argument("--consumers", default="1,2,3")
    parser.add_argument("--ctas-per-sm", default="1", help="comma-separated, of 1 and 2 (2: one consumer warpgroup)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=None, help="write <out>/<tag>.json and .md (benchmarks.records)")
    parser.add_argument("--tag", default="split-probe")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if any(m not in MODELS for m in models):
        parser.error(f"--models: each one of {sorted(MODELS)}, got {args.models!r}")
    try:
        splits = [int(s) for s in args.splits.split(",")]
        consumers = [int(c) for c in args.consumers.split(",")]
        ctas_per_sm = tuple(dict.fromkeys(int(c) for c in args.ctas_per_sm.split(",")))
    except ValueError:
        parser.error(f"--splits, --consumers and --ctas-per-sm: comma-separated integers, got {args.splits!r}, "
                     f"{args.consumers!r}, {args.ctas_per_sm!r}")
    if any(s < 1 for s in splits):
        parser.error(f"--splits: positive counts, got {args.splits!r}")
    if any(c not in (1, 2, 3, 4) for c in consumers):
        parser.error(f"--consumers: 1 to 4 warpgroups, got {args.consumers!r}")
    if any(c not in (1, 2) for c in ctas_per_sm):
        parser.error(f"--ctas-per-sm: 1 or 2, got {args.ctas_per_sm!r}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.split_probe needs a CUDA GPU")
    rows = [row for m in models for row in probe(m, args.batch, args.context, splits, consumers, args.reps,
                                                             ctas_per_sm)]
    text = table(rows)
    print(text)
    if args.out:
        from . import records

        meta = records.run_meta("benchmarks.split_probe", argv, {})
        records.write(args.out, args.tag, "Few-KV-head decode over split counts and consumer warpgroups", meta, rows,
                      text)


if __name__ == "__main__":
    main()

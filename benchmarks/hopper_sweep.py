"""Time the Hopper decode kernel over a few split counts (CUDA-graph replays, L2-cold working set).

    python -m benchmarks.hopper_sweep [--configs 8x32768,1x32768] [--splits auto,2,4] [--consumers auto,2,3]

Qwen3-8B attention geometry (32 q heads, 8 KV heads, head_dim 128), page size 128. Prints one
row per (variant, consumer warpgroups, batch x context, splits): microseconds per call and TB/s
of bytes read, after checking that consumer count against the float64 reference (ragged lengths,
3 splits).
"""

from __future__ import annotations

import argparse
import sys

import torch

from foscar.scheme import Scheme

from .decode import clones, copies_for, time_layers

VARIANTS = {
    "int2-kc128": Scheme.make(2, "channel", 128, "token", 128, 128, 4),
    "int4-kt128": Scheme.make(4, "token", 128, "token", 128, 128, 4),
    "int2-kt128": Scheme.make(2, "token", 128, "token", 128, 128, 4),
    "int4-kc128": Scheme.make(4, "channel", 128, "token", 128, 128, 4),
}


def cache_sets(scheme, batch, context, kv_heads=8, page_size=128):
    """``q``, enough clones of one random cache that a graph replay over all reads >= 4x L2, and
    the bytes one decode call over one cache reads."""
    from foscar.testing import random_problem

    q, cache = random_problem(scheme, [context] * batch, kv_heads=kv_heads, page_size=page_size, shuffle=False)
    nbytes = cache.nbytes() + 2 * q.numel() * q.element_size()
    return q, clones(cache, copies_for(nbytes)), nbytes


def planned_splits(batch, kv_heads, max_tokens):
    from foscar.decode import plan_splits

    return plan_splits(batch, kv_heads, max_tokens, torch.cuda.get_device_properties(0).multi_processor_count)


def layers(scheme, batch, context, splits, consumers, kv_heads=8, page_size=128):
    """Decode closures over :func:`cache_sets`; (fns, bytes per call, splits)."""
    from foscar.hopper.decode import KERNELS

    q, sets, nbytes = cache_sets(scheme, batch, context, kv_heads, page_size)
    if splits is None:
        splits = planned_splits(batch, kv_heads, sets[0].max_tokens)
    fns = [
        (lambda c=c: KERNELS.run_decode(q, c.k_codes, c.k_params, c.v_codes, c.v_params, c.page_table, c.lengths,
                                        scheme.head_dim**-0.5, scheme, splits, consumers=consumers))
        for c in sets
    ]
    return fns, nbytes, splits


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variants", default="int2-kc128,int4-kt128")
    parser.add_argument("--configs", default="8x32768,1x32768,32x8192")
    parser.add_argument("--splits", default="auto")
    parser.add_argument("--consumers", default="auto")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks.hopper_sweep needs a CUDA GPU")
    # a row is printed as soon as it is measured (a run cut short by a time limit keeps what it measured)
    print(f"{'variant':12} {'WGs':>4} {'ok':>3} {'BxL':>10} {'splits':>6} {'us':>8} {'TB/s':>6}", flush=True)
    for name in args.variants.split(","):
        for consumers in [None if c == "auto" else int(c) for c in args.consumers.split(",")]:
            ok = check(VARIANTS[name], consumers)
            for cfg in args.configs.split(","):
                batch, context = map(int, cfg.split("x"))
                for sp in args.splits.split(","):
                    fns, nbytes, splits = layers(VARIANTS[name], batch, context, None if sp == "auto" else int(sp), consumers)
                    us = time_layers(fns, reps=20)
                    print(f"{name:12} {consumers or 'auto':>4} {'yes' if ok else 'NO':>3} {f'{batch}x{context}':>10} "
                          f"{splits:>6} {us:8.1f} {nbytes / us / 1e6:6.2f}", flush=True)
                    del fns
                    torch.cuda.empty_cache()


def check(scheme, consumers) -> bool:
    """The kernel with ``consumers`` warpgroups against the float64 reference (ragged, 3 splits)."""
    from foscar.hopper.decode import KERNELS
    from foscar.testing import check_output, random_problem

    q, cache = random_problem(scheme, [1, 700, 4097, 129], kv_heads=3, page_size=128)
    c = cache
    out, lse = KERNELS.run_decode(q, c.k_codes, c.k_params, c.v_codes, c.v_params, c.page_table, c.lengths,
                                  scheme.head_dim**-0.5, scheme, 3, consumers=consumers)
    acc = check_output(out, lse, q, cache, scheme.head_dim**-0.5)
    if not acc.ok:
        print(f"{scheme.name} consumers={consumers}: {acc}")
    return acc.ok


if __name__ == "__main__":
    main()

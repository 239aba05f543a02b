"""One-off probe (session 25): the decode of 4 query tokens per sequence (gqa 4 x 4 = 16 query columns per KV head)
under other launch options than the default (2 consumer warpgroups at one CTA per SM, the plan's splits):
one consumer warpgroup at two CTAs per SM (whose 16-column loop does not spill for INT4) with twice the splits, and
2 warpgroups with twice the splits. Each variant is checked against the default launch's output first.

    python benchmarks/results/probe-verify-options-2026-12-04.py
"""
import dataclasses
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.decode import MODELS, clones, copies_for, scheme_of, time_layers  # noqa: E402
from foscar.decode import plan_splits  # noqa: E402
from foscar.hopper.decode import KERNELS  # noqa: E402
from foscar.testing import random_problem  # noqa: E402

SHAPES = [("qwen3-8b", 8, 32768), ("qwen3-8b", 1, 131072)]
METHODS = ["int2-kt128", "int2-kc128", "int4-kt128"]
VARIANTS = [("default", 1, {}), ("1wg x 2ctas, 2x splits", 2, {"consumers": 1, "ctas_per_sm": 2}),
            ("2wg, 2x splits", 2, {"consumers": 2}), ("1wg x 2ctas, 4x splits", 4, {"consumers": 1, "ctas_per_sm": 2})]


def layers(scheme, q, caches, splits, options):
    sm = scheme.head_dim**-0.5
    return [(lambda c=c: KERNELS.run_decode(q, c.k_codes, c.k_params, c.v_codes, c.v_params, c.page_table, c.lengths,
                                            sm, scheme, splits, **options)) for c in caches]


rows = []
for model, batch, context in SHAPES:
    hq, kvh, d = MODELS[model]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for method in METHODS:
        scheme = dataclasses.replace(scheme_of(method), head_dim=d, gqa_ratio=hq // kvh)
        q1, cache = random_problem(scheme, [context] * batch, kv_heads=kvh, page_size=128, shuffle=False)
        caches = clones(cache, copies_for(cache.nbytes()))
        base = plan_splits(batch, kvh, cache.max_tokens, sms)
        one = time_layers(layers(scheme, q1, caches, base, {}), 20)
        q4 = torch.randn(batch, 4, *q1.shape[1:], device="cuda").to(q1.dtype)
        ref = None
        for name, mult, options in VARIANTS:
            fns = layers(scheme, q4, caches, base * mult, options)
            out, _ = fns[0]()
            torch.cuda.synchronize()
            if ref is None:
                ref = out.float().clone()
            err = (out.float() - ref).abs().max().item()
            us = time_layers(fns, 20)
            rows.append((model, batch, context, method, name, base * mult, one, us, err))
            print(rows[-1], flush=True)
        del caches, cache
        torch.cuda.empty_cache()

print("| shape | method | 4-token variant | splits | 1 token us | 4 tokens us | ratio | max diff vs default |")
print("|---|---|---|---|---|---|---|---|")
for model, batch, context, method, name, splits, one, us, err in rows:
    print(f"| {model} {batch}x{context} | {method} | {name} | {splits} | {one:.1f} | {us:.1f} | {us / one:.2f}x | {err:.1e} |")

"""The dequantize kernel (``foscar.kernels.dequantize``) against the torch dequantizer and a BF16 copy, in one process.

    python -m benchmarks.dequantize [--batches 1,4] [--methods int2-kc128,int4-kt128] [--out benchmarks/results]

Qwen3-8B's KV geometry (8 KV heads, head_dim 128), ``--tokens`` (32K) per sequence in pages of 128 (shuffled), one
row per (method, batch, tensor K or V, packed bit order, path):

* ``kernel``: ``dequantize_pages`` into a preallocated BF16 tensor, in a CUDA graph: the GPU time;
* ``kernel-eager``: the same call from Python between CUDA events, as ``PagedKVCache._cached_blocks`` makes it
  (host overhead included: the per-call cost of a small block);
* ``torch``: the torch dequantizer of a CPU cache's ``_cached_blocks`` (``QuantizedKV.codes_and_params`` +
  ``dequantize_groups`` in FP32, then BF16), eager between CUDA events: it moves its code-order table to the GPU
  on each call, which a CUDA graph cannot capture;
* ``bf16-copy``: ``torch`` copying a BF16 tensor of the output's size (read + write): the write ceiling.

Timing: median of ``--reps`` (a graph replays every copy once: enough cache copies that a replay moves at least
4x the 60 MB L2, so inputs come from HBM, as ``benchmarks.decode``). ``TB/s``: bytes read (codes + params, or
the copy's source) plus bytes written, per call. Each (method, batch, order, tensor) first checks the kernel's
output against the torch dequantizer in float64, rounded once to FP32 then to BF16 (its FMA): every element equal
(``tests/test_dequantize.py`` covers the formats and shapes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from .decode import MODELS, _versions, clones, copies_for, event_times, scheme_of, time_layers
from .records import run_meta, write

PAGE = 128  # tokens per page, the cache's default
LAYOUTS = ("hopper", "blackwell")
PATHS = ("kernel", "kernel-eager", "torch", "bf16-copy")


def eager_us(fn, reps: int) -> float:
    """Median microseconds of ``fn()`` called from Python between CUDA events, after a warm-up call."""
    fn()
    return statistics.median(event_times(fn, reps))


def packed_caches(scheme, batch: int, tokens: int, layout: str):
    """A random cache of ``batch`` sequences of ``tokens`` (``foscar.testing.random_problem``, pages shuffled) and
    the bytes the kernel reads per call of each role (its codes and params)."""
    from foscar.testing import random_problem

    _, cache = random_problem(scheme, [tokens] * batch, kv_heads=MODELS["qwen3-8b"][1], page_size=PAGE,
                              shuffle=True, layout=layout)
    pages = cache.page_table.numel()  # every entry is read once
    read = {role: pages * sum(t[0].numel() * t.element_size() for t in pair)
            for role, pair in (("k", (cache.k_codes, cache.k_params)), ("v", (cache.v_codes, cache.v_params)))}
    return cache, read


def measure(method: str, batch: int, tokens: int, layout: str, reps: int):
    """The rows of one (method, batch, layout): each role, each path."""
    from foscar.kernels.dequantize import dequantize_pages
    from foscar.quantize import dequantize_groups

    scheme = scheme_of(method)
    cache, read = packed_caches(scheme, batch, tokens, layout)
    rows = []
    for role in ("k", "v"):
        shape = (batch, cache.kv_heads, cache.max_tokens, scheme.head_dim)
        written = torch.Size(shape).numel() * 2
        sets = clones(cache, copies_for(read[role] + written))
        outs = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in sets]

        def kernel(c, out):
            codes, params = (c.k_codes, c.k_params) if role == "k" else (c.v_codes, c.v_params)
            return dequantize_pages(codes, params, c.page_table, scheme, role, layout=layout, out=out)

        def torch_path():
            return dequantize_groups(*cache.codes_and_params(role)).to(torch.bfloat16)

        # the kernel's one FMA, exactly: the torch dequantizer in float64, rounded once to FP32, then to BF16
        exact = dequantize_groups(*cache.codes_and_params(role), dtype=torch.float64).float().bfloat16()
        if not torch.equal(kernel(cache, outs[0]), exact):
            raise AssertionError(f"{method} {layout} {role}: the kernel and the torch dequantizer differ")
        del exact
        sources = [torch.randn(shape, device="cuda").bfloat16() for _ in sets]
        timings = {
            "kernel": (time_layers([lambda c=c, o=o: kernel(c, o) for c, o in zip(sets, outs)], reps),
                       read[role] + written, len(sets)),
            "kernel-eager": (eager_us(lambda: kernel(cache, outs[0]), reps), read[role] + written, 1),
            "torch": (eager_us(torch_path, reps), read[role] + written, 1),
            "bf16-copy": (time_layers([lambda s=s, o=o: o.copy_(s) for s, o in zip(sources, outs)], reps),
                          2 * written, len(sets)),
        }
        for path, (us, nbytes, copies) in timings.items():
            rows.append({"method": method, "batch": batch, "tokens": tokens, "role": role, "layout": layout,
                         "path": path, "us": us, "bytes": nbytes, "tbps": nbytes / us / 1e6, "copies": copies})
            print(f"{method} b{batch} {role} {layout} {path}: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s", flush=True)
        torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    lines = ["| method | batch | tensor | layout | path | us | TB/s | vs kernel |", "|---|---|---|---|---|---|---|---|"]
    kernel = {(r["method"], r["batch"], r["role"], r["layout"]): r["us"] for r in rows if r["path"] == "kernel"}
    for r in rows:
        base = kernel[r["method"], r["batch"], r["role"], r["layout"]]
        lines.append(f"| {r['method']} | {r['batch']} | {r['role'].upper()} | {r['layout']} | {r['path']} | "
                     f"{r['us']:.1f} | {r['tbps']:.2f} | {r['us'] / base:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="int2-kc128,int4-kt128",
                        help="FOSCAR formats, <format>-k<t|c><group> (V token-wise in groups of 128), comma-separated")
    parser.add_argument("--batches", default="1,4", help="sequences per call, comma-separated")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per sequence (a multiple of 128)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="packed bit orders, comma-separated")
    parser.add_argument("--reps", type=int, default=30, help="timed calls or graph replays per row")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--tag", default="dequantize")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    for method in methods:
        try:
            known = scheme_of(method) is not None and not method.endswith("+sw")
        except ValueError as exc:  # a format nobody registered
            parser.error(f"--methods: {exc}")
        if not known:
            parser.error(f"--methods: {method!r} is not <format>-k<t|c><group>")
    layouts = [x for x in args.layouts.split(",") if x]
    if not layouts or any(x not in LAYOUTS for x in layouts):
        parser.error(f"--layouts must name some of {LAYOUTS}, got {args.layouts!r}")
    try:
        batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        parser.error(f"--batches must be positive integers, got {args.batches!r}")
    if args.tokens < PAGE or args.tokens % PAGE:
        parser.error(f"--tokens must be a positive multiple of {PAGE}, got {args.tokens}")
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    if not torch.cuda.is_available():
        sys.exit("benchmarks.dequantize needs a CUDA GPU")
    rows = [row for method in methods for batch in batches for layout in layouts
            for row in measure(method, batch, args.tokens, layout, args.reps)]
    meta = run_meta("benchmarks.dequantize", argv, _versions(), kv_heads=MODELS["qwen3-8b"][1], head_dim=128,
                    page_size=PAGE, reps=args.reps, cuda=torch.version.cuda)
    text = table(rows)
    write(args.out, args.tag, "Dequantize a packed cache to BF16", meta, rows, text,
          f"Qwen3-8B KV (8 heads, head_dim 128), {args.tokens} tokens per sequence, pages of {PAGE} shuffled; "
          f"median of {args.reps}; kernel and bf16-copy: CUDA graph over >= 240 MB per replay; kernel-eager and "
          "torch: eager calls between CUDA events. TB/s: bytes read + written. ")
    print(text)


if __name__ == "__main__":
    main()

"""Which fused attention ``foscar.chunk_attention`` gives a block of cached tokens: FlashAttention-2
(``_scaled_dot_product_flash_attention``) against cuDNN's (``_scaled_dot_product_cudnn_attention``), whole or cut into
pieces (a batch), in one process.

    python -m benchmarks.fused_attention [--kv-heads 8] [--tokens 32768] [--rows 64,512,4096] [--reps 10]

A BF16 block of ``--tokens`` keys per head, ``--rows`` query rows per head (a chunk's tokens x gqa), head_dim 128.
Timing: the mean of ``--reps`` eager calls between CUDA events after one warm-up (the pieces' contiguous copies are
made outside the timing). The ``new shape`` rows time one call whose key count the process has not seen before
(host clock, synchronized): torch plans a cuDNN attention once per shape, and a chunk over a growing prefix meets a
new shape at every call unless its blocks come from a bounded set (``foscar.chunk_attention``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .decode import _versions
from .records import run_meta, write

PIECES = (4, 16)


def mean_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / reps * 1e3


def flash(q, k, v):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=0.1)


def cudnn(q, k, v):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=0.1)


def new_shape_us(fn, kv_heads: int, tokens: int, rows: int, reps: int) -> float:
    """Median microseconds of a call of ``fn`` on a key count not seen before (``tokens + 1``, ``+ 2``, ...)."""
    q = torch.randn(1, kv_heads, rows, 128, device="cuda", dtype=torch.bfloat16)
    times = []
    for extra in range(1, reps + 1):
        k = torch.randn(1, kv_heads, tokens + extra, 128, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(q, k, k)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return sorted(times)[len(times) // 2]


def measure(kv_heads: int, tokens: int, rows_list, reps: int):
    d = 128
    k = torch.randn(1, kv_heads, tokens, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    rows_out = []
    for rows in rows_list:
        q = torch.randn(1, kv_heads, rows, d, device="cuda", dtype=torch.bfloat16)
        cases = {"fa2": lambda: flash(q, k, v), "cudnn": lambda: cudnn(q, k, v)}
        for pieces in PIECES:
            span = tokens // pieces
            k_p = k[0, :, :pieces * span].unflatten(1, (pieces, span)).transpose(0, 1)
            v_p = v[0, :, :pieces * span].unflatten(1, (pieces, span)).transpose(0, 1)
            q_p = q.expand(pieces, -1, -1, -1).contiguous()
            k_c, v_c = k_p.contiguous(), v_p.contiguous()
            cases[f"fa2 {pieces} pieces"] = lambda q_p=q_p, k_p=k_p, v_p=v_p: flash(q_p, k_p, v_p)
            cases[f"cudnn {pieces} pieces"] = lambda q_p=q_p, k_c=k_c, v_c=v_c: cudnn(q_p, k_c, v_c)
        for name, fn in cases.items():
            us = mean_us(fn, reps)
            tflops = 4 * rows * tokens * d * kv_heads / us / 1e6
            rows_out.append({"rows": rows, "kernel": name, "us": us, "tflops": tflops})
            print(f"rows {rows} {name}: {us:.1f} us ({tflops:.0f} TFLOPS)", flush=True)
        for name, fn in (("fa2", flash), ("cudnn", cudnn)):
            us = new_shape_us(fn, kv_heads, tokens, rows, min(reps, 5))
            rows_out.append({"rows": rows, "kernel": f"{name} new shape", "us": us, "tflops": None})
            print(f"rows {rows} {name} on a new shape: {us:.0f} us", flush=True)
    return rows_out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32768, help="cached tokens of the block, per head")
    parser.add_argument("--rows", default="64,512,4096", help="query rows per head, comma-separated")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--tag", default="fused-attention")
    args = parser.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r]
    if not rows or min(rows) < 1 or args.tokens < max(PIECES) or args.kv_heads < 1 or args.reps < 1:
        parser.error("--rows, --tokens (>= 16), --kv-heads and --reps must be positive")
    if not torch.cuda.is_available():
        sys.exit("benchmarks.fused_attention needs a CUDA GPU")
    data = measure(args.kv_heads, args.tokens, rows, args.reps)
    meta = run_meta("benchmarks.fused_attention", argv, _versions())
    lines = ["| rows per head | kernel | us | TFLOPS |", "|---|---|---|---|"]
    tflops = ["-" if r["tflops"] is None else f"{r['tflops']:.0f}" for r in data]  # none for a new shape's call
    lines += [f"| {r['rows']} | {r['kernel']} | {r['us']:.1f} | {t} |" for r, t in zip(data, tflops)]
    text = "\n".join(lines)
    write(args.out, args.tag, "A block's fused attention: FA2 vs cuDNN", meta, data, text,
          f"{args.kv_heads} KV heads, {args.tokens} tokens, head_dim 128, BF16; mean of {args.reps} eager calls. ")
    print(text)


if __name__ == "__main__":
    main()

"""A chunk of new tokens over a long cached prefix (chunked prefill, a prefix-cache hit, a new turn), in one
process: what FOSCAR does today against the two baselines of issue 25 item 2.

    python -m benchmarks.extend [--prefix 100000] [--chunks 16,128,1024,8192] [--method int2-kc128]
                                [--decode-up-to 1024]

Rows per chunk size (Qwen3-8B attention: 32 query / 8 KV heads, head_dim 128, one sequence, causal within the chunk):

* ``flashinfer-bf16``: FlashInfer's batch prefill over a BF16 paged cache holding the prefix + the chunk
  (``BatchPrefillWithPagedKVCacheWrapper``, HND pages of 64, planned once): what a BF16 cache costs an engine.
* ``dequant+flashinfer``: OSCAR's approach with the project's own kernels: the packed pages dequantized to BF16
  (``foscar.kernels.dequantize``), the 16-bit sink + window slots and the chunk gathered next to them, then
  FlashInfer's ragged batch prefill (``BatchPrefillWithRaggedKVCacheWrapper``, NHD: the gather writes that layout,
  one copy as a concatenation would be) over them. Extra memory: the whole prefix in BF16.
* ``foscar-attend-chunk``: ``PagedKVCache.attend_chunk`` on a kernel cache (``foscar.chunk_attention``), its packed
  pages attended one of three ways, a row each (the call's own choice follows ``PREFILL_COLUMNS`` and
  ``DECODE_COLUMNS``): ``prefill``, by the Hopper prefill kernel (``PackedPrefill``: 128 query rows a CTA, each packed
  tile dequantized once per CTA in shared memory, never in BF16 in global memory; only for a scheme the route gives
  it, ``Arch.takes_prefill``); ``blocks``, dequantized a block at a time into a fused attention; ``decode``, by the
  folded decode kernel with the chunk's tokens as query heads (``PackedPrefix``: the pages read once per 16 rows,
  never in BF16), measured up to ``--decode-up-to`` tokens.
  The 16-bit slots and the chunk's own tokens take the fused attention either way; all merge by LSE.
* ``foscar-attend-chunk, growing prefix``: the same, each call after a one-token append, as in serving, where the
  prefix is one step longer at every call: the last block and the slots are new shapes each time (what a fused
  attention that plans per shape would pay at every call; ``foscar.chunk_attention`` keeps cuDNN off them).

``single_prefill_with_kv_cache`` of the pinned FlashInfer dies with SIGFPE on a 100K-token K/V on the H200
(2026-12-02); the batch wrappers are what engines call for chunked prefill anyway.

Timing: eager calls between CUDA events, median of ``--reps`` after a warm-up (``attend_chunk`` plans on the host and
cannot be captured in a CUDA graph; the FlashInfer rows are timed the same way for a like comparison); beside it the
host time until a call returns and the GPU work of one call (torch's profiler), which say whether a row is bound by
the host issuing it (benchmarks/NOTES.md section 45). ``extra MiB``:
the peak allocation of a call above what was allocated before it (issue 25: memory proportional to the chunk, not the
prefix). Correctness of each path is the tests' business (``tests/test_cache_chunk.py``, ``tests/test_dequantize.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time

import torch

from .decode import MODELS, _versions, event_times, import_flashinfer, scheme_of
from .records import run_meta, write

SINK, WINDOW = 64, 256
PAGE = 64  # tokens per page of the BF16 baseline's cache, as benchmarks.decode's FlashInfer rows
GROWTH = 1024  # tokens the growing-prefix rows may append in one run


def timed(fn, reps: int):
    """(median microseconds of ``fn()``, its peak extra allocation in MiB, microseconds of its first call: what
    shapes seen for the first time cost, e.g. a fused attention's plan, as a changing prefix length meets them; the
    first chunk size's also holds the kernels' compiles or compile-cache loads; the median host microseconds until
    a call returns, from an idle GPU; the microseconds of GPU work one call launches). A call whose time is well
    above its GPU work, with its host time near its time, is bound by the host issuing it."""
    torch.cuda.synchronize()
    first = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first[0].record()
    fn()
    first[1].record()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = event_times(fn, reps)
    extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    return statistics.median(times), extra, first[0].elapsed_time(first[1]) * 1e3, host_us(fn, reps), gpu_us(fn)


def host_us(fn, reps: int) -> float:
    """Median microseconds until ``fn()`` returns, the GPU idle at each call."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def gpu_us(fn) -> float:
    """Microseconds of GPU work (kernels, copies, fills) of one ``fn()``, from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def growing_us(cache, seq, fn, reps: int, generator) -> float:
    """Median microseconds of ``fn()``, each call after appending one random token to ``seq`` (not timed)."""
    kv_heads, d = cache.kv_heads, cache.scheme.head_dim

    def append_one():
        k = torch.randn(1, kv_heads, 1, d, device="cuda", dtype=torch.bfloat16, generator=generator)
        cache.append(0, [seq], k, torch.randn_like(k))

    return statistics.median(event_times(fn, reps, before=append_one))


def foscar_prefix(scheme, kv_heads, prefix, generator):
    """A one-layer PagedKVCache holding one sequence of ``prefix`` random tokens, and its id."""
    from foscar.cache import PagedKVCache

    # room for the growing-prefix rows' one-token appends
    cache = PagedKVCache(scheme, 1, kv_heads, num_pages=-(-(prefix + GROWTH) // 128) + 2, max_seqs=1,
                         max_seq_len=prefix + GROWTH + 8192,
                         sink=SINK, window=WINDOW)
    seq = cache.allocate()
    for start in range(0, prefix, 8192):
        n = min(8192, prefix - start)
        k = torch.randn(1, kv_heads, n, scheme.head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
        cache.append(0, [seq], k, torch.randn_like(k))
    return cache, seq


def dequantized_prefix(cache, seq):
    """OSCAR's step: the sequence's K and V in BF16 ``[kv_heads, n, D]`` (dequantized pages, then its 16-bit slots)."""
    from foscar.kernels.dequantize import dequantize_pages

    n = cache.seq_len(seq)
    qn = cache.quantized_tokens(n)
    table = cache.page_table[seq:seq + 1, :max(1, -(-qn // cache.page_size))].contiguous()
    lengths = torch.tensor([n], device="cuda")
    slots = cache._valid_slots(lengths, torch.tensor([qn], device="cuda"))[0].nonzero()[:, 0]
    out = []
    for role, codes, params, bf16 in (("k", cache.k_codes, cache.k_params, cache.k_bf16),
                                      ("v", cache.v_codes, cache.v_params, cache.v_bf16)):
        pages = dequantize_pages(codes[0], params[0], table, cache.scheme, role)[0, :, :qn]
        out.append(torch.cat([pages, bf16[0, seq][:, slots]], dim=1))
    return out


def flashinfer_paged(flashinfer, workspace, k, v, chunk, q_heads):
    """``run(q)``: FlashInfer's causal batch prefill of ``chunk`` query tokens over BF16 ``k, v [kv_heads, n, D]``
    (the last ``chunk`` of them are the chunk's own) copied into HND pages of ``PAGE``, planned here."""
    kv_heads, n, d = k.shape
    pages = -(-n // PAGE)
    cache = torch.zeros(pages, 2, kv_heads, PAGE, d, device="cuda", dtype=torch.bfloat16)
    for role, x in enumerate((k, v)):
        padded = torch.nn.functional.pad(x, (0, 0, 0, pages * PAGE - n))
        cache[:, role] = padded.view(kv_heads, pages, PAGE, d).transpose(0, 1)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
    i32 = dict(device="cuda", dtype=torch.int32)
    wrapper.plan(torch.tensor([0, chunk], **i32), torch.tensor([0, pages], **i32), torch.arange(pages, **i32),
                 torch.tensor([n - PAGE * (pages - 1)], **i32), q_heads, kv_heads, d, PAGE, causal=True,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return lambda q: wrapper.run(q, cache)


def flashinfer_ragged(flashinfer, workspace, n, chunk, q_heads, kv_heads, d):
    """``run(q, k, v)``: FlashInfer's causal ragged batch prefill of ``chunk`` query tokens over NHD
    ``k, v [n, kv_heads, D]``, planned here."""
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    i32 = dict(device="cuda", dtype=torch.int32)
    wrapper.plan(torch.tensor([0, chunk], **i32), torch.tensor([0, n], **i32), q_heads, kv_heads, d, causal=True,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return wrapper.run


@contextlib.contextmanager
def packed_path(path: str):
    """``attend_chunk`` with its packed pages taken one way: "prefill" (``foscar.cache.PREFILL_COLUMNS`` unbounded),
    "decode" (``DECODE_COLUMNS`` unbounded, no prefill) or "blocks" (neither)."""
    import foscar.cache

    kept = foscar.cache.PREFILL_COLUMNS, foscar.cache.DECODE_COLUMNS
    foscar.cache.PREFILL_COLUMNS = 1 << 62 if path == "prefill" else 0
    foscar.cache.DECODE_COLUMNS = 1 << 62 if path == "decode" else 0
    try:
        yield
    finally:
        foscar.cache.PREFILL_COLUMNS, foscar.cache.DECODE_COLUMNS = kept


def measure(method: str, prefix: int, chunks, reps: int, decode_up_to: int):
    flashinfer = import_flashinfer()
    q_heads, kv_heads, d = MODELS["qwen3-8b"]
    scheme = scheme_of(method)
    gen = torch.Generator("cuda").manual_seed(0)
    cache, seq = foscar_prefix(scheme, kv_heads, prefix, gen)
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    rows = []
    for chunk in chunks:
        q = torch.randn(chunk, q_heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k_all = torch.randn(kv_heads, prefix + chunk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v_all = torch.randn_like(k_all)
        k_new, v_new = k_all[:, prefix:].contiguous(), v_all[:, prefix:].contiguous()
        bf16 = functools.partial(flashinfer_paged(flashinfer, workspace, k_all, v_all, chunk, q_heads), q)
        del k_all, v_all
        # (the cache's prefix: the growing rows of earlier chunk sizes appended a few tokens to it)
        ragged = flashinfer_ragged(flashinfer, workspace, cache.seq_len(seq) + chunk, chunk, q_heads, kv_heads, d)

        def oscar():
            gathered = []
            for pre, new in zip(dequantized_prefix(cache, seq), (k_new, v_new)):
                nhd = torch.empty(pre.shape[1] + chunk, kv_heads, d, device="cuda", dtype=torch.bfloat16)
                nhd[:pre.shape[1]].copy_(pre.transpose(0, 1))
                nhd[pre.shape[1]:].copy_(new.transpose(0, 1))
                gathered.append(nhd)
            return ragged(q, *gathered)

        def foscar():
            return cache.attend_chunk(0, [seq], q[None], k_new[None], v_new[None])

        def packed_by(path):  # attend_chunk with its packed pages taken one way
            def call():
                with packed_path(path):
                    return foscar()
            return call

        paths = (*(("prefill",) if cache.arch.takes_prefill(scheme) else ()),  # (else the row would be another path)
                 "blocks", *(("decode",) if chunk <= decode_up_to else ()))
        for name, fn in (("flashinfer-bf16", bf16), ("dequant+flashinfer", oscar),
                         *((f"foscar-attend-chunk, {p}", packed_by(p)) for p in paths)):
            us, extra, first, host, gpu = timed(fn, reps)
            rows.append({"prefix": prefix, "chunk": chunk, "method": name, "us": us, "extra_mib": extra,
                         "first_us": first, "host_us": host, "gpu_us": gpu})
            print(f"prefix {prefix} chunk {chunk} {name}: {us:.0f} us (first call {first:.0f}; host {host:.0f}, GPU "
                  f"work {gpu:.0f}), +{extra:.0f} MiB", flush=True)
        us = growing_us(cache, seq, foscar, reps, gen)
        rows.append({"prefix": prefix, "chunk": chunk, "method": "foscar-attend-chunk, growing prefix", "us": us,
                     "extra_mib": None, "first_us": None})
        print(f"prefix {prefix}+ chunk {chunk} foscar-attend-chunk, growing prefix: {us:.0f} us", flush=True)
    return rows


def table(rows) -> str:
    lines = ["| prefix | chunk | method | us | vs flashinfer-bf16 | extra MiB | first call us | host us "
             "| GPU work us |", "|---|---|---|---|---|---|---|---|---|"]
    base = {(r["prefix"], r["chunk"]): r["us"] for r in rows if r["method"] == "flashinfer-bf16"}
    def number(x):
        return "-" if x is None else f"{x:.0f}"

    for r in rows:
        lines.append(f"| {r['prefix']} | {r['chunk']} | {r['method']} | {r['us']:.0f} | "
                     f"{r['us'] / base[r['prefix'], r['chunk']]:.2f}x | {number(r['extra_mib'])} | "
                     f"{number(r.get('first_us'))} | {number(r.get('host_us'))} | {number(r.get('gpu_us'))} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=100_000, help="cached tokens before the chunk")
    parser.add_argument("--chunks", default="16,128,1024,8192", help="new tokens, comma-separated")
    parser.add_argument("--method", default="int2-kc128", help="the FOSCAR format, <format>-k<t|c><group>")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--decode-up-to", type=int, default=1024,
                        help="the longest chunk whose packed pages are also timed through the decode kernel")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--tag", default="extend")
    args = parser.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",") if c]
    if not chunks or min(chunks) < 1 or max(chunks) > 8192:
        parser.error(f"--chunks must be 1..8192 tokens each, got {args.chunks!r}")
    if args.prefix < SINK + WINDOW + 256:
        parser.error(f"--prefix must leave packed pages (at least {SINK + WINDOW + 256} tokens), got {args.prefix}")
    if not 1 <= args.reps * len(chunks) <= GROWTH:
        parser.error(f"--reps x chunk sizes must lie in 1..{GROWTH} (the growing rows append one token per rep), got "
                     f"{args.reps} x {len(chunks)}")
    if scheme_of(args.method) is None or args.method.endswith("+sw"):
        parser.error(f"--method: {args.method!r} is not <format>-k<t|c><group>")
    if not torch.cuda.is_available():
        sys.exit("benchmarks.extend needs a CUDA GPU")
    rows = measure(args.method, args.prefix, chunks, args.reps, args.decode_up_to)
    meta = run_meta("benchmarks.extend", argv, _versions(), method=args.method)
    text = table(rows)
    write(args.out, args.tag, f"A chunk over a cached prefix ({args.method})", meta, rows, text,
          f"Eager calls, CUDA events, median of {args.reps}; sink {SINK} + window {WINDOW}. ")
    print(text)


if __name__ == "__main__":
    main()

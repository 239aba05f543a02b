"""Decode-attention benchmark: FOSCAR variants and the baselines, side by side, in one process.

    python -m benchmarks.decode [--quick] [--out benchmarks/results]
    python -m benchmarks.decode --rows qwen3-8b:256x2048,tp8-70b:1x131072 --methods flashinfer-bf16,int2-kt128+sw

Baselines: FlashInfer BF16 paged decode (tensor cores), FlashInfer FP8 (e4m3) KV decode through the
same wrapper (``flashinfer-fp8``) and through FlashInfer's XQA kernel (``flashinfer-fp8-xqa``: on
sm_90 TensorRT-LLM's Hopper FP8 kernel, whose products take Q and P in e4m3), torch SDPA BF16
(enable_gqa), and a Triton read-bandwidth ceiling. The table's "vs FI fp8" is against the faster of
the FP8 baselines run for that config. A baseline that cannot be imported is reported as missing,
never dropped silently; one whose FlashInfer lacks its path stops the run before the sweep.
FlashInfer is installed by the ``bench`` extra (``pip install -e '.[bench]'``, flashinfer-python;
``benchmarks/fi_bundle.sh`` bundles another release for the GPU machine); Triton comes with CUDA
builds of torch.

Timing: every method is captured in one CUDA graph that runs it over ``copies`` distinct buffer
sets ("layers"), enough that the working set of one replay is at least 4x the 60 MB L2, so no
layer finds its data in L2; the graph is replayed after a warm-up and the median replay time over
``copies`` is the time of one layer call. Bytes are those the method must read (codes, params,
Q) and write (O).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import importlib
import importlib.util
import platform
import re
import statistics
import sys
from dataclasses import asdict, dataclass, field

import torch

BASELINES = ("flashinfer-bf16", "flashinfer-fp8", "flashinfer-fp8-xqa", "sdpa-bf16")
FP8_BASELINES = ("flashinfer-fp8", "flashinfer-fp8-xqa")  # "vs FI fp8" takes the faster of those run
FASTEST_FP8 = "fastest FI fp8"  # the geo-means' name of that choice
XQA_PAGE = 64  # tokens per page of the XQA baseline, as the wrapper's (XQA takes 16, 32, 64 or 128)
L2_BYTES = 60 * 2**20
WORKING_SET = 4 * L2_BYTES

# (batch, context) of the standard sweep; Qwen3-8B attention: 32 q heads, 8 KV heads, head_dim 128
STANDARD = [(1, 32768), (1, 131072), (8, 32768), (32, 8192), (32, 32768), (64, 16384), (128, 8192)]
QUICK = [(1, 32768), (8, 32768), (128, 8192)]
MODELS = {"qwen3-8b": (32, 8, 128), "llama3-70b": (64, 8, 128), "mha-32": (32, 32, 128),
          # tensor-parallel shards of a 70B-class model (8 query heads per KV head), and head_dim 256
          "tp8-70b": (8, 1, 128), "tp4-70b": (16, 2, 128), "d256": (16, 4, 256)}
EXTRA = [("llama3-70b", 8, 32768), ("llama3-70b", 32, 8192), ("mha-32", 8, 8192), ("mha-32", 1, 32768)]
# where serving spends its time (issue 12): few KV heads at batch 1 and at large batch, head_dim 256,
# many short sequences
SERVING = [("tp8-70b", 1, 131072), ("tp8-70b", 64, 8192), ("tp4-70b", 1, 131072), ("tp4-70b", 32, 16384),
           ("d256", 8, 32768), ("qwen3-8b", 256, 2048)]


@dataclass
class Row:
    model: str
    batch: int
    context: int
    method: str
    us: float | None = None
    bytes: int = 0
    copies: int = 0
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tbps(self):
        return None if not self.us else self.bytes / self.us / 1e6


def import_flashinfer():
    """The flashinfer module, or an ImportError that says how to install it (the benchmarks' baseline;
    foscar itself does not need it)."""
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError(f"{exc}: FlashInfer is the bench extra, pip install -e '.[bench]' (flashinfer-python)") \
            from None
    return flashinfer


def progress(items, desc):
    try:
        from tqdm import tqdm
    except ImportError:  # still show where the sweep is
        def tqdm(it, desc, total):
            for i, x in enumerate(it):
                print(f"[{desc}] {i + 1}/{total}", file=sys.stderr, flush=True)
                yield x
    return tqdm(items, desc=desc, total=len(items))


def copies_for(nbytes: int) -> int:
    return max(1, math.ceil(WORKING_SET / max(nbytes, 1)))


def clones(cache, copies: int):
    """``copies`` caches with the same contents in distinct buffers (the first is ``cache``): a graph replay over all
    of them reads from HBM, not L2."""
    names = ("k_codes", "k_params", "v_codes", "v_params")
    return [cache] + [type(cache)(**{**cache.__dict__, **{n: getattr(cache, n).clone() for n in names}})
                      for _ in range(copies - 1)]


def event_times(fn, reps: int, before=None) -> list[float]:
    """Microseconds of ``reps`` eager calls of ``fn()``, each between CUDA events on an idle stream (no warm-up);
    ``before()``, untimed, precedes each call (e.g. an append that grows the cache)."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return times


def time_layers(layer_fns, reps: int = 30) -> float:
    """Median microseconds per layer: one CUDA graph runs every layer once; replay it ``reps`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in layer_fns:  # warm-up outside the graph (JIT, workspace allocation)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in layer_fns:
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / len(layer_fns))
    return statistics.median(times)


# ----------------------------------------------------------------------------- baselines
def read_ceiling_us(nbytes=4 * 2**30, copies=1):
    """Time the Triton read kernel of ``benchmarks.ceiling`` over ``nbytes``; with ``copies`` > 1 one
    call reads one of that many buffers (so a small read comes from HBM, not L2, as a decode call's)."""
    from .ceiling import read_layer

    grid = torch.cuda.get_device_properties(0).multi_processor_count * 8
    out = torch.empty(grid, dtype=torch.int32, device="cuda")
    xs = [torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda") for _ in range(copies)]
    return time_layers([read_layer(x, out, grid) for x in xs], reps=20), nbytes


class FlashInferDecode:
    """FlashInfer BatchDecodeWithPagedKVCacheWrapper (HND pages of 64, tensor cores); ``lengths``:
    per-sequence token counts (default ``context`` each), planned by FlashInfer on the host."""

    def __init__(self, batch, context, q_heads, kv_heads, head_dim, kv_dtype, lengths=None):
        flashinfer = import_flashinfer()
        page = 64
        lengths = [context] * batch if lengths is None else list(lengths)
        pages = [-(-n // page) for n in lengths]
        self.kv_dtype = kv_dtype
        num_pages = sum(pages)
        dev = "cuda"
        self.cache = torch.randn(num_pages, 2, kv_heads, page, head_dim, device=dev, dtype=torch.bfloat16).to(kv_dtype)
        indptr = torch.tensor([0] + pages, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        indices = torch.arange(num_pages, device=dev, dtype=torch.int32)
        last = torch.tensor([n - page * (p - 1) for n, p in zip(lengths, pages)], device=dev, dtype=torch.int32)
        self.workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=dev)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "HND", use_tensor_cores=True)
        self.wrapper.plan(indptr, indices, last, q_heads, kv_heads, head_dim, page, q_data_type=torch.bfloat16,
                          kv_data_type=kv_dtype)
        # what the wrapper picked (fa2 for an FP8 cache under a BF16 query, fa3 for BF16 on sm_90)
        self.path = f"wrapper {getattr(self.wrapper, '_backend', '?')}"
        self.q = torch.randn(batch, q_heads, head_dim, device=dev, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)
        self.nbytes = self.cache.numel() * self.cache.element_size() + 2 * self.q.numel() * 2

    def __call__(self, cache=None):
        kw = dict(k_scale=1.0, v_scale=1.0) if self.kv_dtype != torch.bfloat16 else {}
        self.wrapper.run(self.q, self.cache if cache is None else cache, out=self.out, **kw)


def xqa_decode_of(flashinfer):
    """FlashInfer's XQA decode entry (``flashinfer.decode.xqa_batch_decode_with_kv_cache``), or an ImportError
    that names the method and the installed FlashInfer version."""
    decode = getattr(flashinfer, "decode", None)
    entry = getattr(decode, "xqa_batch_decode_with_kv_cache", None)
    if entry is None:
        raise ImportError(f"flashinfer-fp8-xqa needs flashinfer.decode.xqa_batch_decode_with_kv_cache, which the "
                          f"installed flashinfer {getattr(flashinfer, '__version__', '?')} lacks "
                          "(benchmarks/fi_bundle.sh bundles 0.7.4)")
    return entry


def xqa_kernel(capability, head_dim):
    """Which XQA kernel FlashInfer's ``xqa`` runs on an FP8 cache: the Hopper one (mha_sm90: FP8 GMMA, so Q and P
    are rounded to e4m3 for the products) on sm_90 with head_dim <= 256, the generic one (mha.cu) elsewhere."""
    if capability[0] == 9 and head_dim <= 256:
        return "XQA mha_sm90 (FP8 GMMA, Q and P in e4m3)"
    return "XQA mha.cu (generic)"


class FlashInferXQADecode:
    """FlashInfer's XQA decode (TensorRT-LLM's kernel) over an FP8 e4m3 cache of HND pages of ``XQA_PAGE``
    tokens (K and V of a page in one buffer, as the wrapper's), scales 1, FlashInfer's defaults otherwise (its
    split count, PDL on sm_90, as the wrapper's ``run``)."""

    def __init__(self, batch, context, q_heads, kv_heads, head_dim):
        flashinfer = import_flashinfer()
        self.decode = xqa_decode_of(flashinfer)
        dev = "cuda"
        pages = -(-context // XQA_PAGE)
        self.cache = torch.randn(batch * pages, 2, kv_heads, XQA_PAGE, head_dim, device=dev,
                                 dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        self.block_tables = torch.arange(batch * pages, device=dev, dtype=torch.int32).view(batch, pages)
        self.seq_lens = torch.full((batch,), context, device=dev, dtype=torch.int32).view(torch.uint32)
        self.workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=dev)  # zeroed: its semaphores
        self.q = torch.randn(batch, q_heads, head_dim, device=dev, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)
        self.sm_scale = head_dim**-0.5
        self.nbytes = self.cache.numel() * self.cache.element_size() + 2 * self.q.numel() * 2
        self.path = f"{xqa_kernel(torch.cuda.get_device_capability(), head_dim)}, pages of {XQA_PAGE}"

    def __call__(self, cache=None):
        self.decode(self.q, self.cache if cache is None else cache, self.workspace, self.block_tables, self.seq_lens,
                    self.block_tables.shape[1] * XQA_PAGE, bmm1_scale=self.sm_scale, bmm2_scale=1.0, out=self.out,
                    kv_layout="HND")


def flashinfer_baseline(method, batch, context, q_heads, kv_heads, head_dim):
    """The FlashInfer baseline a method names, ready to call over a cache of its layout."""
    if method == "flashinfer-fp8-xqa":
        return FlashInferXQADecode(batch, context, q_heads, kv_heads, head_dim)
    dtype = torch.bfloat16 if method == "flashinfer-bf16" else torch.float8_e4m3fn
    return FlashInferDecode(batch, context, q_heads, kv_heads, head_dim, dtype)


def check_flashinfer_paths(methods):
    """Stop before the sweep (SystemExit naming the method and the installed version) when a requested
    FlashInfer baseline's path is missing from the installed FlashInfer."""
    if "flashinfer-fp8-xqa" not in methods:
        return
    try:
        xqa_decode_of(import_flashinfer())
    except ImportError as exc:
        raise SystemExit(f"--methods flashinfer-fp8-xqa: {exc}") from None


def sdpa_layer(batch, context, q_heads, kv_heads, head_dim):
    k = torch.randn(batch, kv_heads, context, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, q_heads, 1, head_dim, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * k.numel() * 2 + 2 * q.numel() * 2

    def run():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run, nbytes


# ----------------------------------------------------------------------------- FOSCAR
def foscar_layers(scheme, batch, context, kv_heads, page_size=128, tokens=1):
    """Layer closures over ``copies`` clones of one quantized cache (same codes, distinct buffers); ``tokens``:
    query tokens per sequence (several: ``q [batch, tokens, Hq, D]``, the pages' last tokens, causal)."""
    from foscar.decode import decode_paged, plan_splits
    from foscar.testing import random_problem

    q, cache = random_problem(scheme, [context] * batch, kv_heads=kv_heads, page_size=page_size, shuffle=False)
    if tokens > 1:
        q = torch.randn(batch, tokens, *q.shape[1:], device=q.device).to(q.dtype)
    nbytes = cache.nbytes() + 2 * q.numel() * q.element_size()
    copies = copies_for(nbytes)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = plan_splits(batch, kv_heads, cache.max_tokens, sms)
    sets = [cache] + [
        type(cache)(**{**cache.__dict__, **{n: getattr(cache, n).clone() for n in ("k_codes", "k_params", "v_codes", "v_params")}})
        for _ in range(copies - 1)
    ]
    fns = [
        (lambda c=c: decode_paged(q, c.k_codes, c.k_params, c.v_codes, c.v_params, c.page_table, c.lengths, scheme,
                                  page_size, num_splits=splits, check_pages=False))
        for c in sets
    ]
    return fns, nbytes, copies, splits


def foscar_window_layers(scheme, batch, context, kv_heads, page_size=128, sink=64, window=256, lengths=None,
                         tokens=1, rollback=0):
    """Layer closures of ``PagedKVCache.attend``: BF16 sink + recent window merged with the quantized pages;
    ``lengths``: per-sequence token counts (default ``context`` each); ``tokens``: query tokens per sequence
    (several: ``q [batch, tokens, Hq, D]``, the last tokens, causal: speculative verification; ``rollback``: the
    cache's margin, which lets ``attend`` take that many tokens more than one launch, as earlier launches)."""
    from foscar.cache import PagedKVCache
    from foscar.kernels.quantize import granule_of

    granule = granule_of(scheme)
    lengths = [context] * batch if lengths is None else list(lengths)
    quantized = [granule * max(0, (n - sink - window) // granule) for n in lengths]
    d = scheme.head_dim
    nbytes = int(kv_heads * d * sum(2 * qn * scheme.bytes_per_element() + 2 * 2 * (n - qn)
                                    for n, qn in zip(lengths, quantized)))
    nbytes += 2 * batch * tokens * kv_heads * scheme.gqa_ratio * d * 2
    copies = copies_for(nbytes)
    pages = sum(-(-qn // page_size) for qn in quantized)
    cache = PagedKVCache(scheme, num_layers=copies, kv_heads=kv_heads, num_pages=max(1, pages), max_seqs=batch,
                         max_seq_len=max(lengths), page_size=page_size, sink=sink, window=window, rollback=rollback)
    seqs = [cache.allocate() for _ in range(batch)]
    gen = torch.Generator("cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    uniform = len(set(lengths)) == 1
    for layer in range(copies):
        for group, n in ([(seqs, lengths[0])] if uniform else [([s], n) for s, n in zip(seqs, lengths)]):
            k = torch.randn(len(group), kv_heads, n, d, device="cuda", generator=gen, dtype=scheme.q_dtype)
            cache.append(layer, group, k, torch.randn_like(k))
            del k
    shape = (batch, kv_heads * scheme.gqa_ratio, d) if tokens == 1 else (batch, tokens, kv_heads * scheme.gqa_ratio, d)
    q = torch.randn(shape, device="cuda", generator=gen, dtype=scheme.q_dtype)
    return [(lambda layer=layer: cache.attend(layer, seqs, q)) for layer in range(copies)], nbytes, copies


def import_user_formats(spec: str):
    """Import the module that registers user code formats (``foscar.formats``): a file path
    (``tests/user_formats.py``, imported under its stem) or a dotted module name."""
    if not spec.endswith(".py"):
        return importlib.import_module(spec)
    if not os.path.isfile(spec):
        raise SystemExit(f"--user-formats: no such file {spec!r}")
    name = os.path.splitext(os.path.basename(spec))[0]
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, spec))
    sys.modules[name] = module
    module.__spec__.loader.exec_module(module)
    return module


def scheme_of(method: str):
    """The Scheme a FOSCAR method names (Qwen3-8B geometry; the sweep sets head_dim and GQA per model):
    ``<format>-k<t|c><group>`` (K token- or channel-wise, V token-wise in groups of 128) for any
    registered format (``foscar.formats``: int2, int4, and what ``--user-formats`` registers, e.g. int8, sym-int4),
    or ``k<K>v<V>-k<t|c><group>`` for K and V of two formats (``<K>``, ``<V>``: a bit width of an
    ``int<bits>`` format, or a format name); a trailing ``+sw`` is the cache decode's BF16 sink + window.
    None for a name of another shape (a baseline)."""
    from foscar import Scheme
    from foscar.formats import as_format

    match = re.fullmatch(r"(?P<fmt>.+)-k(?P<axis>[tc])(?P<group>\d+)", method.removesuffix("+sw"))
    if match is None:
        return None
    axis = {"t": "token", "c": "channel"}[match["axis"]]
    mixed = re.fullmatch(r"k(?P<k>[\w-]+?)v(?P<v>[\w-]+)", match["fmt"])
    formats = (mixed["k"], mixed["v"]) if mixed else (match["fmt"], match["fmt"])
    k_fmt, v_fmt = (as_format(int(f) if f.isdigit() else f, f"method {method!r}") for f in formats)
    return Scheme.make(k=axis, k_group=int(match["group"]), v="token", v_group=128, gqa_ratio=4, k_format=k_fmt,
                       v_format=v_fmt)


def loop_stats(methods):
    """SASS main-loop figures (foscar.inspect) of each FOSCAR variant, at the standard geometry."""
    from foscar.hopper.decode import KERNELS
    from foscar.inspect import artifacts, decode_loop_stats

    out = {}
    for method in methods:
        scheme = scheme_of(method)
        if scheme is None or method in out:
            continue
        try:
            art = artifacts(KERNELS.compile_decode(scheme, 128, partial_output=True))
            out[method] = decode_loop_stats(art.loop_mix(full_opcodes=True), scheme.head_dim)
        except Exception as exc:  # e.g. no nvdisasm: say so
            out[method] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def run_sweep(shapes, methods, reps, after_config=None):
    rows = []
    for model, batch, context in progress(shapes, "configs"):
        q_heads, kv_heads, head_dim = MODELS[model]
        for method in methods:
            row = Row(model, batch, context, method)
            try:
                if method.startswith("flashinfer-"):
                    fi = flashinfer_baseline(method, batch, context, q_heads, kv_heads, head_dim)
                    row.bytes, row.copies, row.note = fi.nbytes, copies_for(fi.nbytes), fi.path
                    caches = [fi.cache] + [fi.cache.clone() for _ in range(row.copies - 1)]
                    row.us = time_layers([lambda c=c: fi(c) for c in caches], reps)
                elif method == "sdpa-bf16":
                    row.copies = copies_for(4 * batch * context * kv_heads * head_dim)
                    layers = [sdpa_layer(batch, context, q_heads, kv_heads, head_dim) for _ in range(row.copies)]
                    row.bytes = layers[0][1]
                    row.us = time_layers([fn for fn, _ in layers], reps)
                elif method.endswith("+sw"):
                    scheme = scheme_of(method)
                    scheme = dataclasses.replace(scheme, head_dim=head_dim, gqa_ratio=q_heads // kv_heads)
                    fns, row.bytes, row.copies = foscar_window_layers(scheme, batch, context, kv_heads)
                    row.note = "BF16 sink 64 + window 256"
                    row.us = time_layers(fns, reps)
                else:
                    scheme = scheme_of(method)
                    scheme = dataclasses.replace(scheme, head_dim=head_dim, gqa_ratio=q_heads // kv_heads)
                    fns, row.bytes, row.copies, splits = foscar_layers(scheme, batch, context, kv_heads)
                    row.extra["splits"] = splits
                    row.us = time_layers(fns, reps)
            except ImportError as exc:
                row.note = f"missing: {exc}"
            except Exception as exc:  # report, keep sweeping
                row.note = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            torch.cuda.empty_cache()
        if after_config:  # results so far survive a sweep cut short
            after_config(rows)
    return rows


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def fastest_fp8(by, key):
    """The fastest timed row of ``FP8_BASELINES`` for config ``key`` (model, batch, context), or None."""
    timed = [r for m in FP8_BASELINES if (r := by.get((*key, m))) and r.us]
    return min(timed, key=lambda r: r.us, default=None)


def summarize(rows, ceiling_tbps):
    by = {(r.model, r.batch, r.context, r.method): r for r in rows}
    lines = ["| model | batch | context | method | us | TB/s | % ceiling | vs FI bf16 | vs FI fp8 | vs SDPA | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    speedups = {}
    for r in rows:
        key = (r.model, r.batch, r.context)
        bases = {b: by.get((*key, b)) for b in BASELINES} | {FASTEST_FP8: fastest_fp8(by, key)}
        rel = {b: (base.us / r.us) if (base and base.us and r.us) else None for b, base in bases.items()}
        standard = r.model == "qwen3-8b" and (r.batch, r.context) in STANDARD  # the issue's geo-means
        for base, x in rel.items():
            if standard and r.method not in BASELINES and x:
                speedups.setdefault((r.method, base), []).append(x)
        pct = (100 * r.tbps / ceiling_tbps) if (r.tbps and ceiling_tbps) else None
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        lines.append(f"| {r.model} | {r.batch} | {r.context} | {r.method} | {fmt(r.us, '.1f')} | {fmt(r.tbps, '.2f')} | "
                     f"{fmt(pct, '.0f')} | {fmt(rel['flashinfer-bf16'], '.2f')} | {fmt(rel[FASTEST_FP8], '.2f')} | "
                     f"{fmt(rel['sdpa-bf16'], '.2f')} | {r.note} |")
    geo = {f"{m} vs {b}": geomean(v) for (m, b), v in speedups.items()}
    for method in sorted({r.method for r in rows}):
        fractions = [r.tbps / ceiling_tbps for r in rows
                     if r.method == method and r.model == "qwen3-8b" and (r.batch, r.context) in STANDARD and r.tbps]
        if fractions and ceiling_tbps:
            geo[f"{method} fraction of read ceiling"] = geomean(fractions)
    return "\n".join(lines), geo


def plot(rows, ceiling_tbps, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({r.method for r in rows})
    configs = sorted({(r.model, r.batch, r.context) for r in rows}, key=lambda c: (c[0], c[1] * c[2]))
    by = {(r.model, r.batch, r.context, r.method): r for r in rows}
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, len(configs) * 1.2), 8))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        sp = [((by.get((*c, "flashinfer-bf16")) or Row(*c, "")).us or 0) / r.us if (r := by.get((*c, m))) and r.us else 0 for c in configs]
        fr = [100 * r.tbps / ceiling_tbps if (r := by.get((*c, m))) and r.tbps and ceiling_tbps else 0 for c in configs]
        xs = [j + i * width for j in range(len(configs))]
        ax1.bar(xs, sp, width, label=m)
        ax2.bar(xs, fr, width, label=m)
    labels = [f"{c[0]}\nB{c[1]} L{c[2] // 1024}K" for c in configs]
    for ax, title in ((ax1, "speedup over FlashInfer BF16"), (ax2, "% of measured HBM read ceiling")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))], labels, fontsize=7)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    ax1.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_rows(text: str) -> list[tuple[str, int, int]]:
    """``"qwen3-8b:256x2048,tp8-70b:1x131072"`` as ``[(model, batch, context), ...]``; a ValueError names a bad
    entry."""
    rows = []
    for entry in text.split(","):
        model, _, shape = entry.partition(":")
        batch, _, context = shape.partition("x")
        if model not in MODELS or not (batch.isdigit() and context.isdigit()) or int(batch) < 1 or int(context) < 1:
            raise ValueError(f"{entry!r} is not <model>:<batch>x<context> with a model of {', '.join(MODELS)}")
        rows.append((model, int(batch), int(context)))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="three configs, fewer replays (about a minute)")
    parser.add_argument("--shapes", choices=("standard", "serving", "all"), default="standard",
                        help="standard: the Qwen3-8B sweep + extra models; serving: few KV heads, head_dim 256, "
                             "256 short sequences; all: both")
    parser.add_argument("--rows", default=None, metavar="MODEL:BxC,...",
                        help="these rows, in place of --shapes' and --quick's, e.g. "
                             "qwen3-8b:256x2048,tp8-70b:1x131072 (models: "
                             f"{', '.join(MODELS)})")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--methods", default="flashinfer-bf16,flashinfer-fp8,sdpa-bf16,int2-kt128,int2-kc128,int4-kt128,"
                        "int4-kc128,int2-kc128+sw,int4-kt128+sw")
    parser.add_argument("--tag", default="decode")
    parser.add_argument("--user-formats", default=None, metavar="FILE_OR_MODULE",
                        help="import it first: the code formats it registers (foscar.formats) become methods, "
                             "e.g. --user-formats tests/user_formats.py --methods int8-kt128,k8v4-kc128,"
                             "sym-int4-kt128,ksym-int4v4-kc128")
    parser.add_argument("--reps", type=int, default=None, help="graph replays per row (default 30; 10 with --quick)")
    args = parser.parse_args(argv)
    if args.user_formats:
        import_user_formats(args.user_formats)
    methods = args.methods.split(",")
    for method in methods:  # a typo fails now, naming the choices, not after the first configs
        if method not in BASELINES and scheme_of(method) is None:
            parser.error(f"--methods: {method!r} is neither a baseline {BASELINES} nor <format>-k<t|c><group>[+sw]")
    rows = None
    if args.rows:
        try:
            rows = parse_rows(args.rows)
        except ValueError as err:
            parser.error(f"--rows: {err}")
    if not torch.cuda.is_available():
        sys.exit("benchmarks.decode needs a CUDA GPU")
    check_flashinfer_paths(methods)
    shapes = [("qwen3-8b", b, l) for b, l in (QUICK if args.quick else STANDARD)] + ([] if args.quick else EXTRA)
    if args.shapes != "standard":
        shapes = (shapes if args.shapes == "all" else []) + SERVING
    shapes = rows or shapes
    reps = args.reps or (10 if args.quick else 30)
    ceiling_us, ceiling_bytes = read_ceiling_us()
    ceiling = ceiling_bytes / ceiling_us / 1e6
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.decode " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "versions": _versions(),
        "read_ceiling_tbps": ceiling,
        "timing": f"CUDA graph over >= {WORKING_SET >> 20} MB working set per replay (>= 4x L2), median of {reps} replays",
        "sass_main_loop": loop_stats(methods),
    }
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.tag)
    rows = run_sweep(shapes, methods, reps, lambda rows: save(rows, meta, ceiling, stem))
    table, geo = save(rows, meta, ceiling, stem)
    try:
        plot(rows, ceiling, stem + ".png")
    except Exception as exc:  # a plot is a convenience; the JSON and table are the record
        print(f"plot failed: {exc}", file=sys.stderr)
    print(table)
    print(f"read ceiling {ceiling:.2f} TB/s")
    for k, v in geo.items():
        print(f"geomean {k}: {v:.2f}x" if v else f"geomean {k}: -")


def save(rows, meta, ceiling, stem):
    """Write the JSON record and the markdown table of ``rows``; returns (table, geo-means)."""
    table, geo = summarize(rows, ceiling)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "geomean": geo, "rows": [asdict(r) | {"tbps": r.tbps} for r in rows]}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"# Decode benchmark ({meta['device']}, {meta['date']})\n\n")
        if meta.get("command"):
            f.write(f"Command: `{meta['command']}`\n\n")
        f.write(f"Read ceiling: {ceiling:.2f} TB/s. {meta['timing']}. Versions: {meta['versions']}\n\n")
        f.write(f"vs FI fp8: against the faster of {', '.join(FP8_BASELINES)} for the config (geo-means: "
                f"'vs {FASTEST_FP8}'); a FlashInfer row's note names the path it ran.\n\n{table}\n\n")
        present = {(r.batch, r.context) for r in rows if r.model == "qwen3-8b"} & set(STANDARD)
        f.write(f"Geo-means over the standard sweep's shapes run here ({len(present)} of {len(STANDARD)}; speedups, "
                "and fractions of the read ceiling):\n\n")
        f.write("\n".join(f"- {k}: {v:.2f}" for k, v in geo.items() if v) + "\n")
        f.write("\nSASS main loop per KV element (shift/logic; all instructions), of the default build (split launches "
                "of <= 2K tokens per CTA run 2 consumer warpgroups: benchmarks/NOTES.md section 34):\n\n")
        for method, st in meta["sass_main_loop"].items():
            f.write(f"- {method}: " + (f"{st['shift_logic_per_element']:.2f}; {st['instructions_per_element']:.2f}\n"
                                      if "error" not in st else st["error"] + "\n"))
    return table, geo


def _versions():
    out = {}
    for name in ("flashinfer", "cutlass", "triton"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except Exception as exc:
            out[name] = f"missing ({type(exc).__name__})"
    return out


if __name__ == "__main__":
    main()

"""Host entry points of the Hopper decode kernel: compile (cached) and run on torch CUDA tensors.

The compiled kernel takes raw pointers plus a few runtime int32 extents (batch, kv_heads,
max_pages, num_splits) and the fp32 sm_scale, so one compilation serves every batch size,
sequence length, page count and split count. The compile cache is keyed on
``(scheme, page_size, partial_output, consumers, arch)`` only (``consumers``: consumer warpgroups
per CTA, ``default_consumers(scheme)`` unless a benchmark asks for another count).

``partial_output`` selects the output format: False writes ``o`` bf16 ``[B, Hq, D]`` and ``lse``
fp32 ``[B, Hq]`` (natural log); True writes normalized fp32 partials ``o [B, Hq, S, D]`` and
``lse [B, Hq, S]`` for a combine kernel (an empty split has ``lse = -inf`` and ``o = 0``).
"""

from __future__ import annotations

from ..inspect import compile_for
from ..jit import cached_compile, current_stream, fake_ptr, gmem_ptr, half_type
from ..scheme import Scheme
from .kernel import DecodeConfig, default_consumers

__all__ = ["compile_decode", "run_decode", "compile_cache_decode", "run_cache_decode", "max_query_tokens",
           "DEFAULT_ARCH", "default_consumers"]

DEFAULT_ARCH = "sm_90a"


def compile_decode(scheme: Scheme, page_size: int, partial_output: bool = False, arch: str = DEFAULT_ARCH,
                   consumers: int | None = None):
    """Compile (or fetch from the in-process cache) the decode kernel of ``scheme``.

    Works without a GPU (fake pointers); the result keeps its PTX and cubin (``foscar.inspect``).
    """
    consumers = default_consumers(scheme) if consumers is None else consumers
    key = ("hopper_decode", scheme, int(page_size), bool(partial_output), int(consumers), arch)
    return cached_compile(key, lambda: _build(scheme, page_size, partial_output, arch, consumers))


def _build(scheme, page_size, partial_output, arch, consumers):
    import cuda.bindings.driver as cuda

    from cutlass import Float16, Float32, Int32
    from .kernel import HopperDecodeKernel

    cfg = DecodeConfig(scheme, page_size, partial_output, consumers)
    kernel = HopperDecodeKernel(cfg)
    q_type = cfg.q_dtype

    return compile_for(
        arch,
        kernel,
        fake_ptr(q_type),  # q
        fake_ptr(Int32),  # k codes
        fake_ptr(Float16),  # k params
        fake_ptr(Int32),  # v codes
        fake_ptr(Float16),  # v params
        fake_ptr(Int32),  # page table
        fake_ptr(Int32),  # lengths
        fake_ptr(Float32 if partial_output else q_type),  # o
        fake_ptr(Float32),  # lse
        Int32(1),  # batch
        Int32(1),  # kv_heads
        Int32(1),  # max_pages
        Int32(1),  # num_splits
        Float32(1.0),  # sm_scale
        cuda.CUstream(0),
    )


def run_decode(q, k_codes, k_params, v_codes, v_params, page_table, lengths, sm_scale, scheme: Scheme, num_splits: int = 1,
               out=None, lse=None, arch: str = DEFAULT_ARCH, consumers: int | None = None):
    """Launch on validated CUDA tensors (``foscar.decode.decode_paged`` validates); returns ``(out, lse)``.

    ``out`` (q's dtype ``[B, Hq, D]``) and ``lse`` (fp32 ``[B, Hq]``) are written in place when
    given (a caller can poison them, or keep them static for CUDA graphs). With ``num_splits > 1``
    the kernel writes fp32 partials that ``foscar.kernels.combine`` merges into them.
    """
    import torch
    from cutlass import Float16, Float32, Int32

    from ..kernels.combine import combine_splits

    device = q.device
    batch, hq, d = q.shape
    page_size = k_codes.shape[2] * 64
    partial = num_splits > 1
    compiled = compile_decode(scheme, page_size, partial, arch, consumers)
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(batch, hq, dtype=torch.float32, device=device) if lse is None else lse
    if partial:
        o_part = torch.empty(batch, hq, num_splits, d, dtype=torch.float32, device=device)
        lse_part = torch.empty(batch, hq, num_splits, dtype=torch.float32, device=device)
    else:
        o_part, lse_part = out, lse
    q_type = half_type(q.dtype)
    stream = current_stream(device)
    compiled(
        gmem_ptr(q, q_type),
        gmem_ptr(k_codes, Int32),
        gmem_ptr(k_params, Float16),
        gmem_ptr(v_codes, Int32),
        gmem_ptr(v_params, Float16),
        gmem_ptr(page_table, Int32),
        gmem_ptr(lengths, Int32),
        gmem_ptr(o_part, Float32 if partial else q_type),
        gmem_ptr(lse_part, Float32),
        Int32(batch),
        Int32(k_codes.shape[1]),
        Int32(page_table.shape[1]),
        Int32(num_splits),
        Float32(float(sm_scale)),
        stream,
    )
    if partial:
        combine_splits(o_part, lse_part, out, lse)
    return out, lse


def compile_cache_decode(scheme: Scheme, page_size: int, arch: str = DEFAULT_ARCH, consumers: int | None = None,
                         tokens: int = 1):
    """Compile (or fetch) the decode launch of ``foscar.cache.PagedKVCache`` (``foscar.hopper.fused``:
    packed pages, 16-bit sink + window slots and the split merge in one launch, reading the cache's
    tensors in place; where ``fuses_window`` says no, the quantized splits' partials only) for ``tokens``
    query tokens per sequence (several: the window tiles, or the window kernel, carry the causal mask)."""
    consumers = default_consumers(scheme, tokens) if consumers is None else consumers
    limit, why = max_query_tokens(scheme)
    if not 1 <= tokens <= limit:
        raise ValueError(f"q: {tokens} query tokens per sequence: the {arch} cache decode takes 1..{limit} ({why})")
    key = ("hopper_cache_decode", scheme, int(page_size), int(consumers), arch) + ((int(tokens),) if tokens > 1 else ())
    return cached_compile(key, lambda: _build_cache_decode(scheme, page_size, arch, consumers, tokens))


def max_query_tokens(scheme: Scheme) -> tuple[int, str]:
    """The most query tokens per sequence the cache decode takes, and why no more: ``gqa_ratio x tokens``
    query columns fit one query tile (``foscar.query_rows``; the window tiles, or the window kernel where they
    do not fit the ring, carry the causal mask)."""
    from ..query_rows import MAX_QUERY_COLUMNS

    return MAX_QUERY_COLUMNS // scheme.gqa_ratio, (f"a query tile holds {MAX_QUERY_COLUMNS} rows per KV head: "
                                                   f"gqa_ratio={scheme.gqa_ratio} x tokens")


def _build_cache_decode(scheme, page_size, arch, consumers, tokens):
    import cuda.bindings.driver as cuda
    from cutlass import Float16, Float32, Int32, Int64

    from .fused import HopperCacheDecodeKernel, cache_decode_config

    cfg = cache_decode_config(scheme, page_size, consumers, tokens)
    q_type, i32 = cfg.q_dtype, Int32(1)
    return compile_for(
        arch, HopperCacheDecodeKernel(cfg),
        fake_ptr(q_type),  # q
        fake_ptr(Int32), fake_ptr(Float16), fake_ptr(Int32), fake_ptr(Float16),  # k codes, params, v codes, params
        fake_ptr(Int32),  # page table
        fake_ptr(Int64), fake_ptr(Int64),  # sequence rows, sequence lengths
        fake_ptr(q_type), fake_ptr(q_type),  # k_win, v_win
        fake_ptr(Float32), fake_ptr(Float32),  # partials o, lse
        fake_ptr(q_type), fake_ptr(Float32),  # out, lse
        fake_ptr(Int32),  # counters
        i32, i32, i32, i32, i32, i32, i32, i32, i32,  # batch, kv_heads, max_pages, budget, num_splits, parts, sink,
        # ring, window
        Float32(1.0),  # sm_scale
        cuda.CUstream(0),
    )


def cache_partials(scheme: Scheme, page_size: int, batch: int, kv_heads: int, num_splits: int, budget: int,
                   slots: int, consumers: int | None = None, tokens: int = 1) -> tuple[int, ...]:
    """The shape of the fp32 ``o`` partials :func:`run_cache_decode` allocates (``lse``'s: all but the
    last dim): one launch, one ``[R, D]`` per work item (``foscar.work_list``: at most ``budget + batch *
    kv_heads``; R = gqa x tokens); two, ``[batch, Hq, parts, D]``, the window kernel's partials after the
    splits'."""
    from ..kernels.sink_window import window_ctas
    from ..work_list import grid_ctas
    from .fused import fuses_window

    consumers = default_consumers(scheme, tokens) if consumers is None else consumers
    r, d = scheme.gqa_ratio * tokens, scheme.head_dim
    if fuses_window(scheme, page_size, consumers):
        return (grid_ctas(budget, batch, kv_heads), r, d)
    return (batch, kv_heads * r, num_splits + window_ctas(slots), d)


def run_cache_decode(q, k_codes, k_params, v_codes, v_params, page_table, k_win, v_win, seq_rows, seq_lengths, counters,
                     sink: int, window: int, sm_scale: float, scheme: Scheme, num_splits: int, budget: int,
                     arch: str = DEFAULT_ARCH, consumers: int | None = None):
    """Decode on a cache layer's tensors (``PagedKVCache.attend`` validates them): ``q [B, Hq, D]``, or
    ``q [B, tokens, Hq, D]`` for several query tokens per sequence (the sequence's last tokens: causal),
    packed pages, ``page_table [max_seqs, max_pages]``, 16-bit ``k_win, v_win [max_seqs, kv_heads,
    sink + ring, D]``, ``seq_rows`` int64 [B], ``seq_lengths`` int64 [max_seqs], ``counters`` int32
    (>= B * kv_heads, zero; left zero). One launch (``foscar.hopper.fused``) whose work list fills
    ``budget`` CTAs, or, where ``fuses_window`` says no, ``num_splits`` splits per sequence then the
    window kernel. Returns ``(out, lse)``: q's dtype and shape, fp32 ``lse`` of q's shape less head_dim."""
    import torch
    from cutlass import Float16, Float32, Int32, Int64

    from ..kernels.quantize import granule_of
    from ..kernels.sink_window import check_cache_launch, check_sink_window, sink_window_attend
    from .fused import fuses_window

    device = q.device
    batch, tokens, d = q.shape[0], q.shape[1] if q.dim() == 4 else 1, q.shape[-1]
    kv_heads, slots = k_win.shape[1], k_win.shape[2]
    page_size = k_codes.shape[2] * 64
    consumers = default_consumers(scheme, tokens) if consumers is None else consumers
    one_launch = fuses_window(scheme, page_size, consumers)
    check_cache_launch(num_splits, counters, batch * kv_heads, budget)  # before anything compiles or launches
    if not one_launch:
        check_sink_window(d, scheme.gqa_ratio * tokens, slots)
    compiled = compile_cache_decode(scheme, page_size, arch, consumers, tokens)
    q_type = half_type(q.dtype)
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=device)
    shape = cache_partials(scheme, page_size, batch, kv_heads, num_splits, budget, slots, consumers, tokens)
    o_part = torch.empty(shape, dtype=torch.float32, device=device)
    lse_part = torch.empty(shape[:-1], dtype=torch.float32, device=device)
    compiled(
        gmem_ptr(q, q_type),
        gmem_ptr(k_codes, Int32), gmem_ptr(k_params, Float16), gmem_ptr(v_codes, Int32), gmem_ptr(v_params, Float16),
        gmem_ptr(page_table, Int32),
        gmem_ptr(seq_rows, Int64), gmem_ptr(seq_lengths, Int64),
        gmem_ptr(k_win, q_type), gmem_ptr(v_win, q_type),
        gmem_ptr(o_part, Float32), gmem_ptr(lse_part, Float32),
        gmem_ptr(out, q_type), gmem_ptr(lse, Float32),
        gmem_ptr(counters, Int32),
        Int32(batch), Int32(kv_heads), Int32(page_table.shape[1]), Int32(budget), Int32(num_splits),
        Int32(shape[2] if not one_launch else 0), Int32(sink),
        Int32(slots - sink), Int32(window), Float32(float(sm_scale)),
        current_stream(device),
    )
    if not one_launch:
        sink_window_attend(q, k_win, v_win, seq_rows, seq_lengths, o_part, lse_part, out, lse, counters, num_splits,
                           sink, window, granule_of(scheme), sm_scale, arch)
    return out, lse

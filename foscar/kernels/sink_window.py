"""The 16-bit sink + recent-window slots of ``foscar.cache.PagedKVCache``: a light kernel that
attends them once per KV head, after the decode launch, and merges its partials with the decode's.

The cache keeps the first ``sink`` tokens of a sequence and its most recent ones in unquantized
slots of the model's dtype (``[max_seqs, kv_heads, L, D]``, ``L = sink + ring``) and the rest,
``qlen`` tokens, in packed pages. This kernel runs after the decode launch
(``foscar.hopper.fused``), which wrote partials ``0 .. num_splits - 1`` of ``o_part [B, Hq, total, D]``
/ ``lse_part``: CTA ``(chunk, kv_head, b)`` attends ``CHUNK`` slots of its (sequence, KV head) for
all ``R`` query heads of the KV head (each window byte is read once per KV head, not once per query
head), writes the normalized partial ``(o, lse)`` as ``num_splits + chunk``, and the last of the
(sequence, KV head)'s chunk CTAs merges all ``total`` into the output (``foscar.split_merge``).

Why a kernel of its own, after the decode: its CTAs are small (256 threads, 35-226 KB of shared
memory: 84 KB at head_dim 128 with 4 query heads per KV head), so several share an SM and hide each
other's load and merge latencies. Inside the decode grid every CTA carries the decode ring's ~220 KB:
window CTAs there held whole SMs for a few microseconds of latency, and the decode CTAs' own merge did
too (measured: +sw rows up to 1.6x and 1.06x slower than this order).

Slot ``j`` of a sequence of ``n`` tokens is valid when ``j < sink`` and ``j < n`` (sink), or
``j >= sink`` and ``(j - sink - qlen) mod ring < max(n - sink - qlen, 0)`` (the ring of recent
tokens, ``foscar.cache``).

One thread issues two bulk copies (TMA engine) of the chunk's K and V rows into shared memory;
then SIMT FP32 with ``WARPS`` warps. A warp step covers ``SPS = 32 / LPR`` slots with ``LPR`` lanes
per slot and ``CPL`` channels per lane (16-byte pieces ``c, c + LPR, ...`` of the row for lane
``c``: a quarter-warp reads 128 contiguous bytes, no bank conflict). ``CPL`` is chosen so that a
lane's slice of ``RG`` query rows (scaled q, in registers) or of their outputs is 64 fp32
registers: few lanes per slot, so few shuffles per score (measured: with q in shared memory and 8
channels per lane the kernel was bound by shared-memory issue, 2.4 cycles per instruction).
Scores -> ``S [R, CHUNK]`` in shared memory; one warp per query row turns its scores into
``P = exp2(S - max)`` and the row sum; ``O = P V`` with the same slot/lane split, reduced over a
step's slots by shuffles and over the warps in shared memory.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..device import LOG2E, NEG_INF, fsel
from ..pipeline import bulk_copy_g2s
from ..softmax import finite_reference, normalize
from ..split_merge import SplitMerge

__all__ = ["CHUNK", "MAX_CHUNKS", "SinkWindow", "window_ctas", "quantized_tokens", "lane_split", "shared_storage",
           "shared_bytes", "check_sink_window", "compile_sink_window", "sink_window_attend"]

CHUNK = 128  # slots per CTA: 64 KB of K + V at head_dim 128
MAX_CHUNKS = 32  # sink + window slots up to 4096
CHANNELS_PER_LANE = 8  # one 16-byte load of 16-bit values (a piece)
REGISTER_SLICE = 64  # fp32 registers of a lane's q (or output) slice of the query rows of a pass
WARPS = 8
BAR_MERGE = 1  # named barrier of the merge (all threads)
SMEM_BUDGET = 227 * 1024  # dynamic shared memory per CTA on sm_90 / sm_100


def window_ctas(slots: int) -> int:
    """CTAs per (sequence, KV head) for ``slots`` window slots."""
    return -(-slots // CHUNK)


def quantized_tokens(n, sink, window, granule: int):
    """Tokens of an ``n``-token sequence that live in packed pages (``PagedKVCache.quantized_tokens``),
    on the device: ``granule * max(0, (n - sink - window) // granule)``."""
    return cutlass.max(n - sink - window, Int32(0)) // granule * granule


def lane_split(head_dim: int, rows: int) -> tuple[int, int]:
    """(query rows per pass RG, channels per lane CPL): a lane's slice of RG rows (q, or their
    outputs) is at most ``REGISTER_SLICE`` fp32 registers; CPL a power of two, so that D/CPL lanes
    per slot divide a warp (R = 7 gives RG 7, CPL 8: 16 lanes per slot, 2 slots per warp step)."""
    rg = min(rows, max(1, REGISTER_SLICE // CHANNELS_PER_LANE))
    per_row = REGISTER_SLICE // rg
    cpl = min(head_dim, max(CHANNELS_PER_LANE, 1 << (per_row.bit_length() - 1)))
    return rg, cpl


def shared_storage(head_dim: int, rows: int, dtype=cutlass.BFloat16):
    """The kernel's shared memory of one CTA (a ``cute.struct``; built from a dict because this
    module's annotations are strings (PEP 563) outside jit functions)."""
    merge_words = 2 * rows  # SplitMerge.scratch_words
    fields = {
        "k": cute.struct.Align[cute.struct.MemRange[dtype, CHUNK * head_dim], 128],  # the chunk's K rows
        "v": cute.struct.Align[cute.struct.MemRange[dtype, CHUNK * head_dim], 128],
        "s": cute.struct.Align[cute.struct.MemRange[Float32, rows * CHUNK], 16],  # scores, then P
        "m": cute.struct.MemRange[Float32, rows],
        "l": cute.struct.MemRange[Float32, rows],
        "o": cute.struct.Align[cute.struct.MemRange[Float32, WARPS * rows * head_dim], 16],  # per warp P V
        "merge": cute.struct.Align[cute.struct.MemRange[Float32, merge_words], 16],
        "loaded": cute.struct.MemRange[Int64, 1],  # mbarrier of the two bulk copies
        "last": cute.struct.MemRange[Int32, 1],  # SplitMerge.arrive's answer
    }
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


def shared_bytes(head_dim: int, rows: int) -> int:
    """Bytes of :func:`shared_storage` (what a CTA launches with)."""
    return shared_storage(head_dim, rows).size_in_bytes()


def check_sink_window(head_dim: int, gqa_ratio: int, slots: int, sink_window: str = "sink + window + granule"):
    """Raise a ValueError naming the field if the kernel cannot take ``head_dim`` x ``gqa_ratio`` (its
    shared memory) or ``slots`` 16-bit slots per (sequence, KV head); launches nothing."""
    if head_dim not in (64, 128, 256):
        raise ValueError(f"Scheme.head_dim={head_dim}: the sink + window kernel takes 64, 128 or 256")
    if not 1 <= gqa_ratio <= 16:
        raise ValueError(f"Scheme.gqa_ratio={gqa_ratio}: the sink + window kernel takes 1..16")
    if shared_bytes(head_dim, gqa_ratio) > SMEM_BUDGET:
        raise ValueError(f"Scheme.head_dim={head_dim} with Scheme.gqa_ratio={gqa_ratio}: the sink + window kernel "
                         f"needs {shared_bytes(head_dim, gqa_ratio) // 1024} KB of shared memory per CTA, more than "
                         f"{SMEM_BUDGET // 1024} KB (head_dim 256 takes gqa_ratio <= 11)")
    if not 1 <= slots <= MAX_CHUNKS * CHUNK:
        raise ValueError(f"{sink_window} = {slots} 16-bit slots per sequence: the sink + window kernel takes at most "
                         f"{MAX_CHUNKS * CHUNK}")


class SinkWindow:
    """The kernel (see the module docstring). Compile time: head_dim, R query heads per KV head, the
    16-bit dtype; slots, sink and splits are runtime values. :func:`check_sink_window` states its
    limits before anything launches."""

    def __init__(self, head_dim: int, rows: int, dtype):
        check_sink_window(head_dim, rows, slots=1)
        self.D, self.R = head_dim, rows
        self.dtype = dtype
        self.merger = SplitMerge(head_dim, rows, 32 * WARPS, BAR_MERGE, dtype)
        assert self.merger.scratch_words == 2 * rows  # shared_storage's merge
        self.RG, self.CPL = lane_split(head_dim, rows)  # query rows per pass, channels per lane
        self.LPR = head_dim // self.CPL  # lanes per slot
        self.SPS = 32 // self.LPR  # slots per warp step
        self.PIECES = self.CPL // CHANNELS_PER_LANE  # 16-byte pieces per lane and slot
        # every channel of a slot read by exactly one lane, every slot of a chunk by one lane group
        assert self.LPR * self.PIECES * CHANNELS_PER_LANE == head_dim and 32 % self.LPR == 0, (head_dim, rows)
        assert CHUNK % self.SPS == 0, (head_dim, rows)

    @cute.jit
    def __call__(self, q: cute.Pointer, k_win: cute.Pointer, v_win: cute.Pointer, seq_rows: cute.Pointer,
                 seq_lengths: cute.Pointer, o_part: cute.Pointer, lse_part: cute.Pointer, out: cute.Pointer,
                 lse: cute.Pointer, counters: cute.Pointer, batch: Int32, kv_heads: Int32, num_splits: Int32,
                 sink: Int32, ring: Int32, window: Int32, granule: Int32, sm_scale: Float32, stream: cuda.CUstream):
        SharedStorage = shared_storage(self.D, self.R, self.dtype)
        assert SharedStorage.size_in_bytes() == shared_bytes(self.D, self.R)
        chunks = (sink + ring + CHUNK - 1) // CHUNK
        self.kernel(SharedStorage, q, k_win, v_win, seq_rows, seq_lengths, o_part, lse_part, out, lse, counters,
                    kv_heads, num_splits, chunks, sink, ring, window, granule, sm_scale * LOG2E).launch(
            grid=(chunks, kv_heads, batch), block=(32 * WARPS, 1, 1), smem=SharedStorage.size_in_bytes(),
            stream=stream)

    @cute.kernel
    def kernel(self, SharedStorage: cutlass.Constexpr, q: cute.Pointer, k_win: cute.Pointer, v_win: cute.Pointer,
               seq_rows: cute.Pointer, seq_lengths: cute.Pointer, o_part: cute.Pointer, lse_part: cute.Pointer,
               out: cute.Pointer, lse: cute.Pointer, counters: cute.Pointer, kv_heads: Int32, num_splits: Int32,
               chunks: Int32, sink: Int32, ring: Int32, window: Int32, granule: Int32, scale_log2: Float32):
        D, R = self.D, self.R
        tidx, _, _ = cute.arch.thread_idx()
        chunk, h, b = cute.arch.block_idx()
        warp, lane = cute.arch.make_warp_uniform(tidx // 32), tidx % 32
        smem = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        row = cute.make_tensor(seq_rows + b, cute.make_layout((1,)))[0]  # the sequence's row (Int64)
        n = Int32(cute.make_tensor(seq_lengths + row, cute.make_layout((1,)))[0])
        qlen = quantized_tokens(n, sink, window, granule)
        slots = sink + ring
        j0 = chunk * CHUNK
        loaded = smem.loaded.data_ptr()
        if tidx == 0:
            cute.arch.mbarrier_init(loaded, 1)
            cute.arch.mbarrier_init_fence()
            nbytes = cutlass.min(CHUNK, slots - j0) * D * 2
            first = ((row * kv_heads + h) * slots + j0) * D  # element of the chunk's first slot
            cute.arch.mbarrier_arrive_and_expect_tx(loaded, 2 * nbytes)
            bulk_copy_g2s(smem.k.data_ptr(), k_win + first, nbytes, loaded)
            bulk_copy_g2s(smem.v.data_ptr(), v_win + first, nbytes, loaded)
        q_row0 = (b * kv_heads + h).to(Int64) * R  # first query row of the KV head
        sv = smem.v.get_tensor(cute.make_layout((CHUNK * D,)))
        for el in cutlass.range(cutlass.min(CHUNK, slots - j0) * D + tidx, CHUNK * D, 32 * WARPS, unroll=1):
            sv[el] = self.dtype(0.0)  # rows past the sequence's slots are not copied: P V must not see NaN there
        cute.arch.sync_threads()  # the mbarrier initialized, the V tail zeroed
        cute.arch.mbarrier_wait(loaded, 0)
        self.scores(smem, q, q_row0, scale_log2, j0, n, qlen, sink, ring, warp, lane)
        cute.arch.sync_threads()
        self.softmax(smem, warp, lane)
        cute.arch.sync_threads()
        self.weighted_values(smem, warp, lane)
        cute.arch.sync_threads()
        total = num_splits + chunks
        self.store(smem, o_part, lse_part, q_row0, num_splits + chunk, total, tidx)
        if self.merger.arrive(counters + (b * kv_heads + h), smem.last.data_ptr(), chunks, tidx):
            self.merger.merge(smem.merge.data_ptr(), o_part, lse_part, out, lse, q_row0, total, tidx)

    @cute.jit
    def scores(self, smem, q: cute.Pointer, q_row0: Int64, scale_log2: Float32, j0: Int32, n: Int32, qlen: Int32,
               sink: Int32, ring: Int32, warp: Int32, lane: Int32):
        """``S[r, j] = q_r . k_j`` (log2 domain), -inf for slots that hold no token."""
        D, R, RG, CPL = self.D, self.R, self.RG, self.CPL
        ss = smem.s.get_tensor(cute.make_layout((R * CHUNK,)))
        c = lane % self.LPR
        recent = cutlass.max(n - sink - qlen, Int32(0))
        for g in cutlass.range_constexpr(-(-R // RG)):
            rows = min(RG, R - g * RG)
            qr = cute.make_rmem_tensor((rows * CPL,), Float32)  # the lane's channels of the pass's rows
            for r in cutlass.range_constexpr(rows):
                for x in cutlass.range_constexpr(self.PIECES):
                    piece = load_channels(q, (q_row0 + g * RG + r) * D + self.channel(c, x), self.dtype)
                    for e in cutlass.range_constexpr(CHANNELS_PER_LANE):
                        qr[r * CPL + x * CHANNELS_PER_LANE + e] = piece[e] * scale_log2
            for step in cutlass.range(warp, CHUNK // self.SPS, WARPS, unroll=1):
                jl = step * self.SPS + lane // self.LPR  # slot within the chunk
                j = j0 + jl
                rel = (j - sink - qlen) % ring
                rel = rel + fsel_i32(rel < 0, ring, 0)  # floor mod
                valid = (j < sink + ring) & cutlass.select_(j < sink, j < n, rel < recent)
                dots = cute.make_rmem_tensor((rows,), Float32)
                dots.fill(0.0)
                for x in cutlass.range_constexpr(self.PIECES):
                    k = load_channels(smem.k.data_ptr(), jl * D + self.channel(c, x), self.dtype)
                    for r in cutlass.range_constexpr(rows):
                        for e in cutlass.range_constexpr(CHANNELS_PER_LANE):
                            dots[r] = dots[r] + qr[r * CPL + x * CHANNELS_PER_LANE + e] * k[e]
                for r in cutlass.range_constexpr(rows):
                    dot = dots[r]
                    for offset in [1 << y for y in range(self.LPR.bit_length() - 1)]:  # over the slot's lanes
                        dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=offset)
                    if c == 0:
                        ss[(g * RG + r) * CHUNK + jl] = fsel(valid, dot, Float32(NEG_INF))

    def channel(self, c, x: int):
        """First channel of piece ``x`` of slot lane ``c`` (the pieces interleave over the lanes)."""
        return CHANNELS_PER_LANE * (c + self.LPR * x)

    @cute.jit
    def softmax(self, smem, warp: Int32, lane: Int32):
        """One warp per query row: ``P = exp2(S - max)`` in place, the row's max and sum."""
        ss = smem.s.get_tensor(cute.make_layout((self.R * CHUNK,)))
        sm = smem.m.get_tensor(cute.make_layout((self.R,)))
        sl = smem.l.get_tensor(cute.make_layout((self.R,)))
        for r in cutlass.range(warp, self.R, WARPS, unroll=1):
            m = Float32(NEG_INF)
            for x in cutlass.range_constexpr(CHUNK // 32):
                m = cute.arch.fmax(m, ss[r * CHUNK + 32 * x + lane])
            m = cute.arch.warp_reduction_max(m)
            m_ref = finite_reference(m)
            total = Float32(0.0)
            for x in cutlass.range_constexpr(CHUNK // 32):
                p = cute.arch.exp2(ss[r * CHUNK + 32 * x + lane] - m_ref)
                ss[r * CHUNK + 32 * x + lane] = p
                total = total + p
            total = cute.arch.warp_reduction_sum(total)
            if lane == 0:
                sm[r] = m
                sl[r] = total

    @cute.jit
    def weighted_values(self, smem, warp: Int32, lane: Int32):
        """This warp's ``sum_j P[r, j] v_j`` over its slots -> ``O[warp, r, :]`` in shared memory
        (P is 0 for the slots past the sequence's, whose V rows the kernel zeroed)."""
        D, R, RG, CPL = self.D, self.R, self.RG, self.CPL
        ss = smem.s.get_tensor(cute.make_layout((R * CHUNK,)))
        so = smem.o.get_tensor(cute.make_layout((WARPS * R * D,)))
        c = lane % self.LPR
        for g in cutlass.range_constexpr(-(-R // RG)):
            rows = min(RG, R - g * RG)
            acc = cute.make_rmem_tensor((rows * CPL,), Float32)
            acc.fill(0.0)
            for step in cutlass.range(warp, CHUNK // self.SPS, WARPS, unroll=1):
                jl = step * self.SPS + lane // self.LPR
                p = cute.make_rmem_tensor((rows,), Float32)
                for r in cutlass.range_constexpr(rows):
                    p[r] = ss[(g * RG + r) * CHUNK + jl]
                for x in cutlass.range_constexpr(self.PIECES):
                    v = load_channels(smem.v.data_ptr(), jl * D + self.channel(c, x), self.dtype)
                    for e in cutlass.range_constexpr(CHANNELS_PER_LANE):
                        for r in cutlass.range_constexpr(rows):
                            i = r * CPL + x * CHANNELS_PER_LANE + e
                            acc[i] = acc[i] + p[r] * v[e]
            for i in cutlass.range_constexpr(rows * CPL):
                for offset in [self.LPR << z for z in range(self.SPS.bit_length() - 1)]:  # over the step's slots
                    acc[i] = acc[i] + cute.arch.shuffle_sync_bfly(acc[i], offset=offset)
            if lane < self.LPR:
                for r in cutlass.range_constexpr(rows):
                    for x in cutlass.range_constexpr(self.PIECES):
                        for e in cutlass.range_constexpr(CHANNELS_PER_LANE):
                            i = r * CPL + x * CHANNELS_PER_LANE + e
                            so[(warp * R + g * RG + r) * D + self.channel(c, x) + e] = acc[i]

    @cute.jit
    def store(self, smem, o_part: cute.Pointer, lse_part: cute.Pointer, q_row0: Int64, split: Int32, total: Int32,
              tidx: Int32):
        """Sum the warps' P V, normalize, write split ``split`` of the ``total`` partials."""
        D, R = self.D, self.R
        so = smem.o.get_tensor(cute.make_layout((WARPS * R * D,)))
        sm = smem.m.get_tensor(cute.make_layout((R,)))
        sl = smem.l.get_tensor(cute.make_layout((R,)))
        for el in cutlass.range(tidx, R * D, 32 * WARPS, unroll=1):
            r = el // D
            o = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                o = o + so[(w * R + r) * D + el % D]
            inv_l, lse = normalize(sl[r], sm[r], fastmath=False)
            prow = (q_row0 + r) * total + split  # partial row of query row q_row0 + r
            cute.make_tensor(o_part + (prow * D + el % D), cute.make_layout((1,)))[0] = o * inv_l
            if el % D == 0:
                cute.make_tensor(lse_part + prow, cute.make_layout((1,)))[0] = lse


def fsel_i32(cond, a, b):
    """Int32 ``cond ? a : b``, branch-free."""
    return Int32(cutlass.select_(cond, Int32(a), Int32(b)))


def load_channels(ptr: cute.Pointer, offset, dtype):
    """The 8 16-bit channels at element ``offset`` (one 16-byte load) as fp32 registers."""
    src = cute.make_tensor(ptr + cute.assume(offset, divby=CHANNELS_PER_LANE), cute.make_layout((CHANNELS_PER_LANE,)))
    raw = cute.make_rmem_tensor((CHANNELS_PER_LANE,), dtype)
    cute.autovec_copy(src, raw)
    vals = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
    vals.store(raw.load().to(Float32))
    return vals


def compile_sink_window(head_dim: int, gqa_ratio: int, arch: str = "sm_90a", dtype=cutlass.BFloat16):
    """Compile (no GPU needed) for ``arch`` with PTX and cubin kept; see ``foscar.inspect``."""
    from ..inspect import compile_for
    from ..jit import fake_ptr

    i32 = Int32(1)
    return compile_for(arch, SinkWindow(head_dim, gqa_ratio, dtype), fake_ptr(dtype), fake_ptr(dtype), fake_ptr(dtype),
                       fake_ptr(Int64), fake_ptr(Int64), fake_ptr(Float32), fake_ptr(Float32), fake_ptr(dtype),
                       fake_ptr(Float32), fake_ptr(Int32), i32, i32, i32, i32, i32, i32, i32, Float32(1.0),
                       cuda.CUstream(0))


def sink_window_attend(q, k_win, v_win, seq_rows, seq_lengths, o_part, lse_part, out, lse, counters, num_splits: int,
                       sink: int, window: int, granule: int, sm_scale: float, arch: str):
    """Launch on a cache layer's tensors (``PagedKVCache.attend`` validates them) after the decode
    launch wrote partials ``0 .. num_splits - 1``: ``q [B, Hq, D]``, ``k_win, v_win [max_seqs,
    kv_heads, sink + ring, D]`` (q's dtype), ``seq_rows`` int64 [B], ``seq_lengths`` int64
    [max_seqs], ``o_part [B, Hq, total, D]`` / ``lse_part [B, Hq, total]`` (fp32), ``counters``
    int32 (>= B * kv_heads, zero; left zero). Writes ``out`` (q's dtype ``[B, Hq, D]``) and ``lse``
    (fp32 ``[B, Hq]``)."""
    import torch

    from ..jit import cached_compile, current_stream, gmem_ptr

    batch, hq, d = q.shape
    kv_heads, slots = k_win.shape[1], k_win.shape[2]
    dtype = cutlass.BFloat16 if q.dtype == torch.bfloat16 else cutlass.Float16
    gqa = hq // kv_heads
    compiled = cached_compile(("sink_window", d, gqa, dtype, arch), lambda: compile_sink_window(d, gqa, arch, dtype))
    compiled(gmem_ptr(q, dtype), gmem_ptr(k_win, dtype), gmem_ptr(v_win, dtype), gmem_ptr(seq_rows, Int64),
             gmem_ptr(seq_lengths, Int64), gmem_ptr(o_part, Float32), gmem_ptr(lse_part, Float32), gmem_ptr(out, dtype),
             gmem_ptr(lse, Float32), gmem_ptr(counters, Int32), Int32(batch), Int32(kv_heads), Int32(num_splits),
             Int32(sink), Int32(slots - sink), Int32(window), Int32(granule), Float32(float(sm_scale)),
             current_stream(q.device))

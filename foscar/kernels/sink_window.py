"""The 16-bit sink + recent-window slots of ``foscar.cache.PagedKVCache`` as a launch of their own:
a light kernel that attends them once per KV head, after Hopper's cache-decode launch where the window
tiles do not fit its ring (head_dim 256 with channel-wise K groups of 256 tokens), and merges its
partials with the decode's. (The cache decodes otherwise attend these slots inside their own launch:
Hopper's as tiles of its ring, ``foscar.hopper.cache_decode``, Blackwell's in its preparation warpgroup,
``foscar.blackwell.cache_decode``. All build on ``foscar.window_tiles``; it compiles for sm_100a too.)

The cache keeps the first ``sink`` tokens of a sequence and its most recent ones in unquantized slots of the
model's dtype (``[max_seqs, kv_heads, L, D]``, ``L = sink + ring``) and the rest, ``qlen`` tokens, in packed
pages. This kernel runs after the decode launch (``foscar.hopper.cache_decode`` without window tiles), which
wrote partials ``0 .. num_splits - 1`` of ``o_part [B, Hq, total, D]`` /
``lse_part``: CTA ``(chunk, kv_head, b)`` attends ``CHUNK`` slots of its (sequence, KV head) for all ``R``
query heads of the KV head (each window byte is read once per KV head, not once per query head), writes the
normalized partial ``(o, lse)`` as ``num_splits + chunk``, and the last of the (sequence, KV head)'s chunk
CTAs merges all ``total`` into the output (``foscar.split_merge``).

Why a kernel of its own, not CTAs of the decode grid: its CTAs are small (256 threads, 37-133 KB of
shared memory), so several share an SM and hide each other's load and merge latencies. Inside the
decode grid every CTA carries the decode ring's ~220 KB: window CTAs there held whole SMs for a few
microseconds of latency (measured on Hopper: +sw rows up to 1.6x slower).

Warp ``w`` owns slots ``16w .. 16w + 15`` of the chunk (``foscar.window_tiles``: which slots hold a
token, the swap-AB Tensor Core operands from padded shared rows). The chunk's K and V rows come in
by ``cp.async`` copies of all threads in two groups (V's land while the scores are computed). The
softmax max and sum of a query column meet across the warps in shared memory; the warps' P V
partial sums meet there too, over the K and V rows once every warp is done with them.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..barriers import WindowBarrier
from ..device import LOG2E, reduce_over_rows
from ..warp_mma import WarpMma
from ..softmax import finite_reference, normalize
from ..split_merge import SplitMerge
from ..query_rows import QueryRows
from ..window_tiles import ROW_PAD, WindowOperands, quantized_tokens, query_columns, slot_holds_token, slot_position

__all__ = ["CHUNK", "MAX_CHUNKS", "SinkWindow", "window_ctas", "shared_storage", "shared_bytes", "check_sink_window",
           "compile_sink_window", "sink_window_attend"]

CHUNK = 128  # slots per CTA: 16 per warp
MAX_CHUNKS = 32  # sink + window slots up to 4096
WARPS = 8
SMEM_BUDGET = 227 * 1024  # dynamic shared memory per CTA on sm_90 / sm_100


def window_ctas(slots: int) -> int:
    """CTAs per (sequence, KV head) for ``slots`` window slots."""
    return -(-slots // CHUNK)


def shared_storage(head_dim: int, rows: int, dtype=cutlass.BFloat16):
    """The kernel's shared memory of one CTA (a ``cute.struct``; built from a dict because this
    module's annotations are strings (PEP 563) outside jit functions)."""
    n = query_columns(rows)
    fields = {
        "k": cute.struct.Align[cute.struct.MemRange[dtype, CHUNK * (head_dim + ROW_PAD)], 128],  # padded rows
        "v": cute.struct.Align[cute.struct.MemRange[dtype, CHUNK * (head_dim + ROW_PAD)], 128],
        "col_max": cute.struct.MemRange[Float32, WARPS * n],  # per warp and query column
        "col_sum": cute.struct.MemRange[Float32, WARPS * n],
        "m": cute.struct.MemRange[Float32, rows],  # the chunk's max score per query row
        "merge": cute.struct.Align[cute.struct.MemRange[Float32, 2 * rows], 16],  # SplitMerge.scratch_words
        "last": cute.struct.MemRange[Int32, 1],  # SplitMerge.arrive's answer
    }
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


def shared_bytes(head_dim: int, rows: int) -> int:
    """Bytes of :func:`shared_storage` (what a CTA launches with)."""
    return shared_storage(head_dim, rows).size_in_bytes()


def check_sink_window(head_dim: int, gqa_ratio: int, slots: int, sink_window: str = "sink + window + granule"):
    """Raise a ValueError naming the field if the kernel cannot take ``head_dim`` x ``gqa_ratio`` or
    ``slots`` 16-bit slots per (sequence, KV head); launches nothing."""
    if head_dim not in (64, 128, 256):
        raise ValueError(f"Scheme.head_dim={head_dim}: the sink + window kernel takes 64, 128 or 256")
    if not 1 <= gqa_ratio <= 16:
        raise ValueError(f"Scheme.gqa_ratio={gqa_ratio}: the sink + window kernel takes 1..16")
    if shared_bytes(head_dim, gqa_ratio) > SMEM_BUDGET:
        raise ValueError(f"Scheme.head_dim={head_dim} with Scheme.gqa_ratio={gqa_ratio}: the sink + window kernel "
                         f"needs {shared_bytes(head_dim, gqa_ratio) // 1024} KB of shared memory per CTA, more than "
                         f"{SMEM_BUDGET // 1024} KB")
    if not 1 <= slots <= MAX_CHUNKS * CHUNK:
        raise ValueError(f"{sink_window} = {slots} 16-bit slots per sequence: the sink + window kernel takes at most "
                         f"{MAX_CHUNKS * CHUNK}")


class SinkWindow:
    """The kernel (see the module docstring). Compile time: head_dim, ``gqa`` query heads per KV head, the
    query ``tokens`` per sequence (``foscar.query_rows``: R = gqa x tokens query columns; several: the
    sequence's last tokens, causal over the slots), the 16-bit dtype; slots, sink and splits are runtime
    values. :func:`check_sink_window` states its limits before anything launches."""

    def __init__(self, head_dim: int, gqa: int, dtype, tokens: int = 1):
        self.query = QueryRows(gqa, tokens)
        rows = self.query.R
        check_sink_window(head_dim, rows, slots=1)
        self.ops = WindowOperands(head_dim, self.query, dtype)
        self.D, self.R = head_dim, rows
        self.PD = self.ops.PD
        self.N = query_columns(rows)
        self.NB = self.N // 8
        self.dtype = dtype
        self.merger = SplitMerge(head_dim, self.query, 32 * WARPS, WindowBarrier.MERGE, dtype)
        # the warps' outputs fit over the K and V rows (32 R D <= 512 (D + 8) bytes for R <= 16), which
        # are adjacent: K's rows are a whole number of 128-byte alignment units
        assert WARPS * rows * head_dim * 4 <= 2 * CHUNK * self.PD * 2, (head_dim, rows)
        assert CHUNK * self.PD * 2 % 128 == 0, head_dim
        assert self.merger.scratch_words == 2 * rows  # shared_storage's merge

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
        D, ops = self.D, self.ops
        tidx, _, _ = cute.arch.thread_idx()
        chunk, h, b = cute.arch.block_idx()
        warp, lane = cute.arch.make_warp_uniform(tidx // 32), tidx % 32
        smem = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        k_rows = cute.recast_ptr(smem.k.data_ptr(), dtype=Int32)
        v_rows = cute.recast_ptr(smem.v.data_ptr(), dtype=Int32)
        row = cute.make_tensor(seq_rows + b, cute.make_layout((1,)))[0]  # the sequence's row (Int64)
        n = Int32(cute.make_tensor(seq_lengths + row, cute.make_layout((1,)))[0])
        qlen = quantized_tokens(n, sink, window, granule)
        j0 = chunk * CHUNK
        rows_in = cutlass.min(CHUNK, sink + ring - j0)  # the chunk's slots in the cache
        first = ((row * kv_heads + h) * (sink + ring) + j0) * D  # element of the chunk's first slot
        recent = cutlass.max(n - sink - qlen, Int32(0))
        holds = lambda j: slot_holds_token(j, n, qlen, sink, ring, recent)  # noqa: E731
        ops.copy_rows(((k_rows, k_win),), first, rows_in, j0, holds, tidx, 32 * WARPS, CHUNK)
        cute.arch.cp_async_commit_group()  # K rows
        ops.copy_rows(((v_rows, v_win),), first, rows_in, j0, holds, tidx, 32 * WARPS, CHUNK)
        cute.arch.cp_async_commit_group()  # V rows, in flight during S

        mma = WarpMma(ops.tiled_mma(), lane, self.NB)
        q_row0 = self.query.first(b, h, kv_heads)  # row of the KV head's query column 0
        q_t = ops.query_fragments(mma, q, q_row0, kv_heads)
        slot = j0 + 16 * warp + mma.g  # this lane's accumulator rows: slots slot and slot + 8
        valid = tuple(holds(j) for j in (slot, slot + 8))
        visible = None  # one query token: it sees every token the slots hold
        if cutlass.const_expr(self.query.tokens > 1):  # several: the causal mask, by the slots' token positions
            positions = [slot_position(j, qlen, sink, ring) for j in (slot, slot + 8)]
            sees = self.query.sees
            visible = lambda nb, i: sees(8 * nb + 2 * mma.tq + i % 2, positions[i // 2], n)  # noqa: E731
        cute.arch.cp_async_wait_group(1)
        cute.arch.sync_threads()  # every thread's K pieces have landed
        s = ops.scores(mma, k_rows, 16 * warp, q_t, scale_log2, valid, visible)
        m = self.column_max(smem, mma, s, warp)
        p_t = self.probabilities(smem, mma, s, m, warp)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # and the V pieces
        o_t = self.weighted_values(mma, v_rows, p_t, warp)
        cute.arch.sync_threads()  # every warp done with K and V: their rows take the warps' outputs
        self.stash(smem, mma, o_t, warp)
        cute.arch.sync_threads()
        total = num_splits + chunks
        self.store(smem, o_part, lse_part, q_row0, kv_heads, num_splits + chunk, total, tidx)
        if self.merger.arrive(counters + (b * kv_heads + h), smem.last.data_ptr(), chunks, tidx):
            partials = lambda: self.merger.row_major(o_part, lse_part, q_row0, kv_heads, total)  # noqa: E731
            self.merger.merge(smem.merge.data_ptr(), partials, out, lse, q_row0, kv_heads, total, tidx)

    @cute.jit
    def column_max(self, smem, mma: WarpMma, s, warp: Int32):
        """Per column slot ``cs = e + 2*nb`` of the lane: the chunk's max score (over all warps)."""
        N = self.N
        cmax = smem.col_max.get_tensor(cute.make_layout((WARPS * N,)))
        first_row = mma.g == 0  # the lanes that hold a reduced column
        for nb in cutlass.range_constexpr(self.NB):
            for e in cutlass.range_constexpr(2):
                x = reduce_over_rows(cute.arch.fmax(s[4 * nb + e], s[4 * nb + 2 + e]), cute.arch.fmax)
                at = warp * N + mma.column(2 * nb + e)
                if first_row:
                    cmax[at] = x
        cute.arch.sync_threads()
        m = cute.make_rmem_tensor((2 * self.NB,), Float32)
        sm = smem.m.get_tensor(cute.make_layout((self.R,)))
        for cs in cutlass.range_constexpr(2 * self.NB):
            col = mma.column(cs)
            m[cs] = cmax[col]
            for w in cutlass.range_constexpr(1, WARPS):
                m[cs] = cute.arch.fmax(m[cs], cmax[w * N + col])
            mine = m[cs]
            if first_row & (warp == 0) & (col < self.R):
                sm[col] = mine
        return m

    @cute.jit
    def probabilities(self, smem, mma: WarpMma, s, m, warp: Int32):
        """P = exp2(S - max) as the B fragments of P^T (one per n8 block: ``movmatrix`` of the S^T
        accumulator), and the warp's column sums of P into shared memory."""
        N = self.N
        csum = smem.col_sum.get_tensor(cute.make_layout((WARPS * N,)))
        first_row = mma.g == 0
        p = cute.make_rmem_tensor((4 * self.NB,), Float32)
        for nb in cutlass.range_constexpr(self.NB):
            for i in cutlass.range_constexpr(4):
                p[4 * nb + i] = cute.arch.exp2(s[4 * nb + i] - finite_reference(m[2 * nb + i % 2]))
            for e in cutlass.range_constexpr(2):
                x = reduce_over_rows(p[4 * nb + e] + p[4 * nb + 2 + e], lambda u, v: u + v)
                at = warp * N + mma.column(2 * nb + e)
                if first_row:
                    csum[at] = x
        return self.ops.probability_fragments(mma, p)

    @cute.jit
    def weighted_values(self, mma: WarpMma, v_rows: cute.Pointer, p_t, warp: Int32):
        """O^T = V^T P^T over the warp's 16 slots: D/16 x NB accumulator fragments (index
        ``mb * NB + nb``), value ``e + 2*h_r`` = channel ``16*mb + g + 8*h_r``, column ``8*nb + 2*tq + e``."""
        o_t = []
        for mb in cutlass.range_constexpr(self.D // 16):
            a = self.ops.value_fragment(mma, v_rows, 16 * warp, mb)
            for nb in cutlass.range_constexpr(self.NB):
                acc = mma.zero_accumulator()
                mma.gemm(acc, a, p_t[nb])
                o_t.append(acc)
        return o_t

    def warp_outputs(self, smem):
        """The warps' O [WARPS, R, D] fp32, over the shared K and V rows (read no more by then)."""
        return cute.make_tensor(cute.recast_ptr(smem.k.data_ptr(), dtype=Float32),
                                cute.make_layout((WARPS * self.R * self.D,)))

    @cute.jit
    def stash(self, smem, mma: WarpMma, o_t, warp: Int32):
        """The warp's O^T into its slot of :meth:`warp_outputs` (columns < R)."""
        D, R = self.D, self.R
        so = self.warp_outputs(smem)
        for mb in cutlass.range_constexpr(D // 16):
            for nb in cutlass.range_constexpr(self.NB):
                for i in cutlass.range_constexpr(4):
                    col = mma.column(2 * nb + i % 2)
                    at = (warp * R + col) * D + 16 * mb + mma.g + 8 * (i // 2)
                    value = o_t[mb * self.NB + nb][i]
                    if col < R:
                        so[at] = value

    @cute.jit
    def store(self, smem, o_part: cute.Pointer, lse_part: cute.Pointer, q_row0: Int64, kv_heads: Int32, split: Int32,
              total: Int32, tidx: Int32):
        """Sum the warps' P V, normalize, write split ``split`` of the ``total`` partials."""
        D, R, N = self.D, self.R, self.N
        offset = self.query.offset  # (a method of a local object is not called inside a runtime loop)
        so = self.warp_outputs(smem)
        sm = smem.m.get_tensor(cute.make_layout((R,)))
        csum = smem.col_sum.get_tensor(cute.make_layout((WARPS * N,)))
        for el in cutlass.range(tidx, R * D, 32 * WARPS, unroll=1):
            r = el // D
            l_sum = Float32(0.0)
            o = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                l_sum = l_sum + csum[w * N + r]
                o = o + so[w * R * D + el]
            inv_l, lse = normalize(l_sum, sm[r], fastmath=False)
            prow = (q_row0 + offset(r, kv_heads)) * total + split  # partial row of query column r
            cute.make_tensor(o_part + (prow * D + el % D), cute.make_layout((1,)))[0] = o * inv_l
            if el % D == 0:
                cute.make_tensor(lse_part + prow, cute.make_layout((1,)))[0] = lse


def compile_sink_window(head_dim: int, gqa_ratio: int, arch: str = "sm_90a", dtype=cutlass.BFloat16, tokens: int = 1):
    """Compile (no GPU needed) for ``arch`` with PTX and cubin kept; see ``foscar.inspect``."""
    from ..inspect import compile_for
    from ..jit import fake_ptr

    i32 = Int32(1)
    return compile_for(arch, SinkWindow(head_dim, gqa_ratio, dtype, tokens), fake_ptr(dtype), fake_ptr(dtype),
                       fake_ptr(dtype),
                       fake_ptr(Int64), fake_ptr(Int64), fake_ptr(Float32), fake_ptr(Float32), fake_ptr(dtype),
                       fake_ptr(Float32), fake_ptr(Int32), i32, i32, i32, i32, i32, i32, i32, Float32(1.0),
                       cuda.CUstream(0))


def sink_window_kernel(q, kv_heads: int, arch: str):
    """The compiled window kernel :func:`sink_window_attend` launches for ``q`` (cached): its caller compiles it
    before the decode launch whose partials it merges, so that nothing can fail between the two launches and leave
    the counters counted."""
    from ..jit import cached_compile, half_type

    tokens, hq, d = q.shape[1:] if q.dim() == 4 else (1, *q.shape[1:])
    dtype, gqa = half_type(q.dtype), hq // kv_heads
    key = ("sink_window", d, gqa, dtype, arch) + ((tokens,) if tokens > 1 else ())
    return cached_compile(key, lambda: compile_sink_window(d, gqa, arch, dtype, tokens))


def sink_window_attend(q, k_win, v_win, seq_rows, seq_lengths, o_part, lse_part, out, lse, counters, num_splits: int,
                       sink: int, window: int, granule: int, sm_scale: float, arch: str):
    """Launch on a cache layer's tensors (``PagedKVCache.attend`` validates them) after the decode
    launch wrote partials ``0 .. num_splits - 1``: ``q [B, Hq, D]`` (or ``[B, tokens, Hq, D]``: the
    sequences' last tokens, causal), ``k_win, v_win [max_seqs, kv_heads, sink + ring, D]`` (q's dtype),
    ``seq_rows`` int64 [B], ``seq_lengths`` int64 [max_seqs], ``o_part`` / ``lse_part`` (fp32: q's rows,
    ``total`` partials each, then ``D``), ``counters`` int32 (>= B * kv_heads, zero; left zero). Writes
    ``out`` (q's dtype and shape) and ``lse`` (fp32, q's shape less head_dim)."""
    from ..jit import half_type, launch

    batch, kv_heads, slots = q.shape[0], k_win.shape[1], k_win.shape[2]
    dtype = half_type(q.dtype)
    launch(sink_window_kernel(q, kv_heads, arch), (q, dtype), (k_win, dtype), (v_win, dtype), (seq_rows, Int64),
           (seq_lengths, Int64), (o_part, Float32), (lse_part, Float32), (out, dtype), (lse, Float32),
           (counters, Int32), (batch, Int32), (kv_heads, Int32), (num_splits, Int32), (sink, Int32), (slots - sink, Int32), (window, Int32),
           (granule, Int32), (float(sm_scale), Float32))

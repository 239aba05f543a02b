"""The 16-bit sink + recent-window slots of a sequence, attended inside the decode launch.

``foscar.cache.PagedKVCache`` keeps the first ``sink`` tokens of a sequence and its most recent
ones in unquantized slots of the model's dtype (``[max_seqs, kv_heads, L, D]``, ``L = sink + ring``)
and the rest, ``qlen`` tokens, in packed pages. The decode grid gives every (sequence, KV head)
``ceil(L / CHUNK)`` extra CTAs next to its quantized splits; each attends one chunk of ``CHUNK``
slots for all ``R`` query heads of the KV head (so each window byte is read once per KV head) and
writes a partial ``(o, lse)`` like a split (``foscar.split_merge`` merges them all).

Slot ``j`` of a sequence of ``n`` tokens is valid when ``j < sink`` and ``j < n`` (sink), or
``j >= sink`` and ``(j - sink - qlen) mod ring < max(n - sink - qlen, 0)`` (the ring of recent
tokens, ``foscar.cache``).

SIMT, FP32, with the CTA's ``NW`` consumer warps. A warp step covers ``32 / LPR`` slots with
``LPR = D / 8`` lanes per slot, 8 channels (one 16-byte load) per lane:
scores (q from shared memory, reduced over the slot's lanes by shuffles) -> shared ``S [R, CHUNK]``;
one warp per query row turns its scores into ``P = exp2(S - max)`` and the row sum; then
``O = P V`` with the same slot/lane split, reduced over the step's slots by shuffles and over the
warps in shared memory. Everything lives in a scratch area of shared memory (the decode ring).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .device import NEG_INF, fsel
from .softmax import finite_reference, normalize

__all__ = ["CHUNK", "SinkWindow", "window_ctas", "quantized_tokens"]

CHUNK = 128  # slots per window CTA: 64 KB of K + V at head_dim 128, a split's worth of bytes
CHANNELS_PER_LANE = 8  # one 16-byte load of 16-bit values


def window_ctas(slots: int) -> int:
    """CTAs per (sequence, KV head) for ``slots`` window slots."""
    return -(-slots // CHUNK)


def quantized_tokens(n, sink, window, granule: int):
    """Tokens of an ``n``-token sequence that live in packed pages (``PagedKVCache.quantized_tokens``),
    on the device: ``granule * max(0, (n - sink - window) // granule)``."""
    return cutlass.max(n - sink - window, Int32(0)) // granule * granule


class SinkWindow:
    """Device side for ``threads`` consumer threads (``NW`` warps) meeting at ``barrier_id``."""

    def __init__(self, head_dim: int, rows: int, warps: int, barrier_id: int, dtype):
        if head_dim % CHANNELS_PER_LANE or 32 % (head_dim // CHANNELS_PER_LANE):
            raise ValueError(f"head_dim must be 64, 128 or 256 for the window slots, got {head_dim}")
        self.D, self.R, self.NW = head_dim, rows, warps
        self.barrier_id = barrier_id
        self.dtype = dtype
        self.LPR = head_dim // CHANNELS_PER_LANE  # lanes per slot
        self.SPS = 32 // self.LPR  # slots per warp step
        self.RG = min(rows, 8)  # query rows per pass of O's accumulators (register budget)
        # scratch (fp32 words): q (scaled) [R, D] | S then P [R, CHUNK] | max [R] | sum [R] | O per warp [NW, R, D]
        self.Q = 0
        self.S = rows * head_dim
        self.M = self.S + rows * CHUNK
        self.L = self.M + rows
        self.O = self.L + rows
        self.words = self.O + warps * rows * head_dim

    def _barrier(self):
        cute.arch.barrier(barrier_id=self.barrier_id, number_of_threads=32 * self.NW)

    @cute.jit
    def attend(self, scratch: cute.Pointer, q_ptr: cute.Pointer, k_win: cute.Pointer, v_win: cute.Pointer,
               slot_row: Int64, n: Int32, qlen: Int32, sink: Int32, ring: Int32, chunk: Int32, q_row0: Int64,
               o_part: cute.Pointer, lse_part: cute.Pointer, split: Int32, total: Int32, scale_log2: Float32,
               warp: Int32, lane: Int32):
        """Chunk ``chunk`` of the slots starting at row ``slot_row`` of ``k_win``/``v_win`` for the query
        rows ``q_row0 .. q_row0 + R - 1`` of ``q``; writes split ``split`` of ``total`` partials."""
        D, R = self.D, self.R
        smem = cute.make_tensor(cute.recast_ptr(scratch, dtype=Float32), cute.make_layout((self.words,)))
        tc = warp * 32 + lane
        for el in cutlass.range(tc, R * D, 32 * self.NW, unroll=1):
            smem[self.Q + el] = cute.make_tensor(q_ptr + (q_row0 * D + el), cute.make_layout((1,)))[0].to(Float32) * scale_log2
        self._barrier()
        j0 = chunk * CHUNK
        self.scores(smem, k_win, slot_row, j0, n, qlen, sink, ring, warp, lane)
        self._barrier()
        self.softmax(smem, warp, lane)
        self._barrier()
        self.weighted_values(smem, v_win, slot_row, j0, sink + ring, warp, lane)
        self._barrier()
        for el in cutlass.range(tc, R * D, 32 * self.NW, unroll=1):
            r = el // D
            o = Float32(0.0)
            for w in cutlass.range_constexpr(self.NW):
                o = o + smem[self.O + (w * R + r) * D + el % D]
            inv_l, lse = normalize(smem[self.L + r], smem[self.M + r], fastmath=False)
            row = (q_row0 + r) * total + split  # [.., total] partial row of query row q_row0 + r
            cute.make_tensor(o_part + (row * D + el % D), cute.make_layout((1,)))[0] = o * inv_l
            if el % D == 0:
                cute.make_tensor(lse_part + row, cute.make_layout((1,)))[0] = lse

    @cute.jit
    def scores(self, smem: cute.Tensor, k_win: cute.Pointer, slot_row: Int64, j0: Int32, n: Int32, qlen: Int32,
               sink: Int32, ring: Int32, warp: Int32, lane: Int32):
        """``S[r, j] = q_r . k_j`` (log2 domain), -inf for slots that hold no token."""
        D, R = self.D, self.R
        c = lane % self.LPR  # the lane's 8 channels: 8c .. 8c + 7
        slots = sink + ring
        recent = cutlass.max(n - sink - qlen, Int32(0))
        for step in cutlass.range(warp, CHUNK // self.SPS, self.NW, unroll=1):
            jl = step * self.SPS + lane // self.LPR  # slot within the chunk
            j = j0 + jl
            rel = (j - sink - qlen) % ring
            rel = rel + fsel_i32(rel < 0, ring, 0)  # floor mod
            valid = (j < slots) & cutlass.select_(j < sink, j < n, rel < recent)
            k = load_channels(k_win, (slot_row + cutlass.min(j, slots - 1)) * D + CHANNELS_PER_LANE * c, self.dtype)
            for r in cutlass.range_constexpr(R):
                dot = Float32(0.0)
                for i in cutlass.range_constexpr(CHANNELS_PER_LANE):
                    dot = dot + smem[self.Q + r * D + CHANNELS_PER_LANE * c + i] * k[i]
                for offset in [1 << x for x in range(self.LPR.bit_length() - 1)]:  # over the slot's lanes
                    dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=offset)
                if c == 0:
                    smem[self.S + r * CHUNK + jl] = fsel(valid, dot, Float32(NEG_INF))

    @cute.jit
    def softmax(self, smem: cute.Tensor, warp: Int32, lane: Int32):
        """One warp per query row: ``P = exp2(S - max)`` in place, the row's max and sum."""
        for r in cutlass.range(warp, self.R, self.NW, unroll=1):
            m = Float32(NEG_INF)
            for x in cutlass.range_constexpr(CHUNK // 32):
                m = cute.arch.fmax(m, smem[self.S + r * CHUNK + 32 * x + lane])
            m = cute.arch.warp_reduction_max(m)
            m_ref = finite_reference(m)
            total = Float32(0.0)
            for x in cutlass.range_constexpr(CHUNK // 32):
                p = cute.arch.exp2(smem[self.S + r * CHUNK + 32 * x + lane] - m_ref)
                smem[self.S + r * CHUNK + 32 * x + lane] = p
                total = total + p
            total = cute.arch.warp_reduction_sum(total)
            if lane == 0:
                smem[self.M + r] = m
                smem[self.L + r] = total

    @cute.jit
    def weighted_values(self, smem: cute.Tensor, v_win: cute.Pointer, slot_row: Int64, j0: Int32, slots: Int32,
                        warp: Int32, lane: Int32):
        """This warp's ``sum_j P[r, j] v_j`` over its slots -> ``O[warp, r, :]`` in shared memory."""
        D, R, RG = self.D, self.R, self.RG
        c = lane % self.LPR
        for g in cutlass.range_constexpr(-(-R // RG)):
            rows = min(RG, R - g * RG)
            acc = cute.make_rmem_tensor((rows * CHANNELS_PER_LANE,), Float32)
            acc.fill(0.0)
            for step in cutlass.range(warp, CHUNK // self.SPS, self.NW, unroll=1):
                jl = step * self.SPS + lane // self.LPR
                j = cutlass.min(j0 + jl, slots - 1)  # P is 0 past the slots
                v = load_channels(v_win, (slot_row + j) * D + CHANNELS_PER_LANE * c, self.dtype)
                for r in cutlass.range_constexpr(rows):
                    p = smem[self.S + (g * RG + r) * CHUNK + jl]
                    for i in cutlass.range_constexpr(CHANNELS_PER_LANE):
                        acc[r * CHANNELS_PER_LANE + i] = acc[r * CHANNELS_PER_LANE + i] + p * v[i]
            for x in cutlass.range_constexpr(rows * CHANNELS_PER_LANE):
                for offset in [self.LPR << y for y in range(self.SPS.bit_length() - 1)]:  # over the step's slots
                    acc[x] = acc[x] + cute.arch.shuffle_sync_bfly(acc[x], offset=offset)
            if lane < self.LPR:
                for r in cutlass.range_constexpr(rows):
                    for i in cutlass.range_constexpr(CHANNELS_PER_LANE):
                        smem[self.O + (warp * R + g * RG + r) * D + CHANNELS_PER_LANE * c + i] = acc[r * CHANNELS_PER_LANE + i]


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

"""The Blackwell cache decode's 16-bit sink + window blocks (``foscar.blackwell.cache_decode``): the softmax
warpgroup attends the CTA's share of them once it has finished its last packed step, with the shared
``foscar.window_tiles`` operands (``mma.sync`` in the window's 16-bit type, valid on sm_100a), and hands
``(O, m, l)`` to the output warpgroup, which merges them with the packed steps' in its epilogue.

Why the softmax warpgroup: after its last step it only waits while the MMA warp issues the last PV and the
output warpgroup takes the last O, and its 160 registers hold the window's state with room to spare. Warps 2
and 3 of warpgroup 0 hold 80 registers (less than a head_dim-256 O^T needs); the preparation warpgroup runs
ahead of the MMAs and would overlap more, but its loop runs at its 112-register ceiling (INT4, head_dim 256):
the window's code there made that loop spill (40 B).

Its 4 warps take every block together: each computes the block's S^T (16 slots x N query columns, all of
head_dim: Q^T fragments loaded from q per k16 block, L1 hits, so no warp holds all of Q in registers)
and so the same online softmax, bit for bit; warp ``w`` keeps O^T of channel blocks ``w * MBW ..``
(MBW = head_dim / 64), at most 32 accumulator registers. A block's K and V rows come in by the
warpgroup's ``cp.async`` (slots holding no token zero-filled: ``foscar.window_tiles``), one block at a
time; the result goes over the rows once the last block is read.

Shared memory (:func:`cache_words`, Int32 words, out of the ring's budget: ``BlackwellConfig``): one
block's K | V rows (then O [R, D] fp32), m and l per query column; and the one-launch decode's work-list
plan and merge scratch. (Q in shared rows too did not fit next to the decode kernel's areas at head_dim
256, token-wise groups of 32 tokens, 16 query columns.)
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.pipeline import NamedBarrier

from ..barriers import BlackwellDecodeBarrier
from ..device import reduce_over_rows
from ..query_rows import KvHead
from ..softmax import online_update
from ..warp_mma import WarpMma
from ..window_tiles import BLOCK, WindowOperands, slot_holds_token, slot_position, window_blocks
from ..work_list import PLAN_WORDS
from .primitives import WG

__all__ = ["cache_areas", "cache_bytes", "WindowBlocks"]


def cache_words(ops: WindowOperands) -> dict[str, int]:
    """Int32 words of each shared area the one-launch cache decode adds to the decode kernel's (module
    docstring); ``ops``: the window's operands."""
    return {
        "win_kv": max(2 * ops.rows_words(BLOCK), ops.R * ops.D),  # a block's K | V rows, then O [R, D] fp32
        "win_ml": 2 * ops.N,  # m [N] | l [N] (log2 domain)
        "plan": PLAN_WORDS,  # foscar.work_list.WorkList.find's scratch and answer
        "merge": 2 * ops.R,  # foscar.split_merge.SplitMerge.scratch_words
        "last": 1,  # SplitMerge.arrive's answer
    }


def cache_areas(ops: WindowOperands):
    """The areas of :func:`cache_words` as a ``cute.struct`` (16-byte aligned fields: the ``cp.async`` rows), which
    the cache decode allocates apart from the decode kernel's ``SharedStorage`` (``foscar.blackwell.cache_decode``)."""
    Align, MemRange = cute.struct.Align, cute.struct.MemRange
    fields = {name: Align[MemRange[Int32, words], 16] for name, words in cache_words(ops).items()}
    return cute.struct(type("CacheAreas", (), {"__annotations__": fields}))


def cache_bytes(ops: WindowOperands) -> int:
    """Shared memory of :func:`cache_areas`, with the 1 KB the decode kernel's ``SharedStorage`` may be aligned past
    it (its own alignment)."""
    return sum((4 * words + 15) // 16 * 16 for words in cache_words(ops).values()) + 1024


class WindowBlocks:
    """Compile time: the kernel's ``BlackwellConfig`` (``cfg.window``: the window's operands)."""

    def __init__(self, cfg):
        self.cfg, self.ops = cfg, cfg.window
        self.D, self.N, self.R = cfg.D, self.ops.N, cfg.R
        self.NB = self.ops.NB
        self.MBW = self.D // 16 // 4  # channel blocks of O^T per warp

    @cute.jit
    def attend(self, seq, q_ptr: cute.Pointer, kv_heads: Int32, scale_log2: Float32):
        """The softmax warpgroup: the blocks ``part, part + parts, ...`` of the sequence's slots (``seq``:
        ``foscar.blackwell.sequence.PlannedSequence``) of KV head ``h`` into (O, m, l) in shared memory, then the
        arrival the output warpgroup's epilogue waits for. Its coordinates are read again here: none stays
        live across the packed steps."""
        ops, slots = self.ops, seq.slots
        tidx, _, _ = cute.arch.thread_idx()
        t, lane, wq = tidx % WG, tidx % 32, cute.arch.make_warp_uniform(tidx // 32 % 4)
        n, qlen, row = seq.tokens(), seq.packed_tokens(), seq.table_row()
        b, h, part, parts, _item0, _facts, _valid = seq.item()
        head = KvHead(b, h, kv_heads)
        count = window_blocks(slots.sink + slots.ring, part, parts)
        k_rows = cute.recast_ptr(seq.areas.win_kv.data_ptr(), dtype=Int32)
        v_rows = k_rows + ops.rows_words(BLOCK)
        mma = WarpMma(ops.tiled_mma(), lane, self.NB)
        q_t = ops.query_on_demand(mma, q_ptr, self.cfg.rows.first(head.b, head.h, head.kv_heads), head.kv_heads)
        m_run = cute.make_rmem_tensor((2 * self.NB,), Float32)
        l_run = cute.make_rmem_tensor((2 * self.NB,), Float32)  # this lane's rows' sums (reduced at the end)
        for cs in cutlass.range_constexpr(2 * self.NB):
            m_run[cs] = Float32(-float("inf"))
            l_run[cs] = Float32(0.0)
        acc_o = [[mma.zero_accumulator() for _ in range(self.NB)] for _ in range(self.MBW)]  # [k][nb]: channel block
        first = (row * head.kv_heads + head.h) * (slots.sink + slots.ring) * self.D  # element of slot 0
        recent = cutlass.max(n - slots.sink - qlen, Int32(0))
        holds = lambda j: slot_holds_token(j, n, qlen, slots.sink, slots.ring, recent)  # noqa: E731
        for i in cutlass.range(count, unroll=1):
            j0 = BLOCK * (part + parts * i)
            rows_in = cutlass.min(BLOCK, slots.sink + slots.ring - j0)
            # (``self.ops``: a method of a local object is not called inside a runtime loop)
            self.ops.copy_rows(((k_rows, slots.k_win), (v_rows, slots.v_win)), first + j0.to(Int64) * self.D, rows_in,
                               j0, holds, t, WG, BLOCK)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            NamedBarrier(BlackwellDecodeBarrier.SOFTMAX, WG).arrive_and_wait()  # every thread's pieces have landed
            self.attend_block(mma, q_t, k_rows, v_rows + 8 * self.MBW * wq, j0, holds, seq, qlen, n, m_run, l_run,
                              acc_o, scale_log2)
            NamedBarrier(BlackwellDecodeBarrier.SOFTMAX, WG).arrive_and_wait()  # every warp done with the rows
        self.hand_over(seq.areas, mma, m_run, l_run, acc_o, wq)

    @cute.jit
    def attend_block(self, mma: WarpMma, q_t, k_rows: cute.Pointer, v_rows: cute.Pointer, j0: Int32,
                     holds, seq, qlen: Int32, n: Int32, m_run: cute.Tensor, l_run: cute.Tensor, acc_o,
                     scale_log2: Float32):
        """The block of slots ``j0 ..`` into the warp's running state: S^T over all channels, the online
        softmax, O^T of the warp's channel blocks (``v_rows``: the V rows from the warp's first channel)."""
        ops, cfg = self.ops, self.cfg
        valid = tuple(holds(j0 + mma.g + 8 * hr) for hr in range(2))
        visible = None  # one query token: it sees every token the slots hold
        if cutlass.const_expr(cfg.rows.tokens > 1):  # several: the causal mask, by the slots' token positions
            slots = seq.slots
            positions = [slot_position(j0 + mma.g + 8 * hr, qlen, slots.sink, slots.ring) for hr in range(2)]
            sees = cfg.rows.sees
            visible = lambda nb, i: sees(8 * nb + 2 * mma.tq + i % 2, positions[i // 2], n)  # noqa: E731
        # (4 NB): value 4*nb + e + 2*h_r = slot j0 + g + 8*h_r, query column 8*nb + 2*tq + e
        # (a runtime loop over the k16 blocks: unrolled, all their loads are hoisted; the window is a small part of
        # the CTA's work)
        sc = ops.scores(mma, k_rows, 0, q_t, scale_log2, valid, visible, unrolled=False)
        reference = cute.make_rmem_tensor((2 * self.NB,), Float32)
        for cs in cutlass.range_constexpr(2 * self.NB):  # column slot cs = e + 2*nb
            nb, e = cs // 2, cs % 2
            mx = reduce_over_rows(cute.arch.fmax(sc[4 * nb + e], sc[4 * nb + 2 + e]), cute.arch.fmax)
            m_run[cs], alpha, reference[cs] = online_update(m_run[cs], mx, cute.arch.exp2)
            l_run[cs] = l_run[cs] * alpha
            for k in cutlass.range_constexpr(self.MBW):
                for hr in cutlass.range_constexpr(2):
                    acc_o[k][nb][e + 2 * hr] = acc_o[k][nb][e + 2 * hr] * alpha
        p = cute.make_rmem_tensor((4 * self.NB,), Float32)
        for x in cutlass.range_constexpr(4 * self.NB):
            cs = x % 2 + 2 * (x // 4)
            p[x] = cute.arch.exp2(sc[x] - reference[cs])
            l_run[cs] = l_run[cs] + p[x]
        p_t = ops.probability_fragments(mma, p)
        for k in cutlass.range_constexpr(self.MBW):
            a = ops.value_fragment(mma, v_rows, 0, k)  # V^T of the warp's channel block k
            for nb in cutlass.range_constexpr(self.NB):
                mma.gemm(acc_o[k][nb], a, p_t[nb])

    @cute.jit
    def hand_over(self, areas, mma: WarpMma, m_run: cute.Tensor, l_run: cute.Tensor, acc_o, wq: Int32):
        """O (unnormalized, fp32 [R, D] over the block's rows), m and l per query column into shared memory, then
        the window barrier's arrival (the output warpgroup waits on it)."""
        D, N, R = self.D, self.N, self.R
        win_o = cute.make_tensor(cute.recast_ptr(areas.win_kv.data_ptr(), dtype=Float32), cute.make_layout((R * D,)))
        win_ml = cute.make_tensor(cute.recast_ptr(areas.win_ml.data_ptr(), dtype=Float32), cute.make_layout((2 * N,)))
        for cs in cutlass.range_constexpr(2 * self.NB):
            l_run[cs] = reduce_over_rows(l_run[cs], operator.add)
        for k in cutlass.range_constexpr(self.MBW):
            for nb in cutlass.range_constexpr(self.NB):
                for i in cutlass.range_constexpr(4):  # channel 16 * (MBW * wq + k) + g + 8 * (i // 2)
                    col = mma.column(2 * nb + i % 2)
                    value = acc_o[k][nb][i]
                    if col < R:
                        win_o[col * D + 16 * (self.MBW * wq + k) + mma.g + 8 * (i // 2)] = value
        cols = [mma.column(cs) for cs in range(2 * self.NB)]  # (no method of a local object inside a runtime `if`)
        if (wq == 0) & (mma.g == 0):  # every warp holds the same m and l: warp 0's lanes of row 0 write them
            for cs in cutlass.range_constexpr(2 * self.NB):
                col = cols[cs]
                m, l_sum = m_run[cs], l_run[cs]
                if col < R:
                    win_ml[col] = m
                    win_ml[N + col] = l_sum
        NamedBarrier(BlackwellDecodeBarrier.WINDOW, 2 * WG).arrive()

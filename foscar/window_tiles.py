"""The 16-bit sink + window slots of ``foscar.cache.PagedKVCache`` as Tensor Core operands, 16 slots
at a time: what both of their consumers share, the Hopper cache-decode kernel (window tiles in its
ring, ``foscar.hopper.cache_decode``) and the separate window kernel (``foscar.kernels.sink_window``).

Swap-AB ``mma.sync.m16n8k16`` in the window's 16-bit type (BF16 or FP16), FP32 accumulate
(``foscar.hopper.mma.WarpMma``), per block of 16 slots:

    S^T [16 slots    x N] = K   [16 slots x 16 ch]    . Q^T [16 ch x N]      (D/16 k16 blocks)
    O^T [16 channels x N] = V^T [16 ch x 16 slots]    . P^T [16 slots x N]   (D/16 m16 blocks)

with N = R query rows padded to 8 or 16 columns. The slots' K and V rows sit in shared memory in
rows padded by 16 bytes (``ROW_PAD``), filled by 16-byte ``cp.async`` copies (:func:`copy_rows`):
the 8 rows of an 8x8 fragment quarter then sit on distinct banks and every fragment register is
one conflict-free 32-bit load; V^T's quarters and P^T are transposed in registers (``movmatrix``).

Slot ``j`` of a sequence of ``n`` tokens, ``qlen`` of them in packed pages, holds a token when
``j < sink`` and ``j < n`` (sink), or ``j >= sink`` and ``(j - sink - qlen) mod ring <
max(n - sink - qlen, 0)`` (the ring of recent tokens, ``foscar.cache``); other slots are zero-filled
by their copies, not read, and masked out of the scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import warp as warp_mma

from .device import NEG_INF, cp_async_16, fsel, movmatrix_trans, pack_bf16x2, pack_f16x2
from .query_rows import QueryRows

__all__ = ["ROW_PAD", "BLOCK", "WindowOperands", "WindowSlots", "slot_holds_token", "slot_position", "quantized_tokens",
           "query_columns", "shared_word_index", "fsel_i32", "window_blocks"]

ROW_PAD = 8  # 16-bit elements of padding per shared K / V row (16 bytes: rows 4 banks apart)
BLOCK = 16  # slots per MMA block (the m16 of S^T)


@dataclass(frozen=True)
class WindowSlots:
    """A cache layer's 16-bit slots (``[max_seqs, kv_heads, sink + ring, D]``, q's dtype) as a cache decode reads
    them: ``sink`` slots, then a ring of ``ring`` for the most recent ``window`` tokens
    (``foscar.cache.PagedKVCache``)."""

    k_win: cute.Pointer
    v_win: cute.Pointer
    sink: Int32
    ring: Int32
    window: Int32


def query_columns(rows: int) -> int:
    """N: the R query rows padded to whole n8 blocks."""
    return 8 if rows <= 8 else 16


def quantized_tokens(n, sink, window, granule: int):
    """Tokens of an ``n``-token sequence that live in packed pages (``PagedKVCache.quantized_tokens``),
    on the device: ``granule * max(0, (n - sink - window) // granule)``."""
    return cutlass.max(n - sink - window, Int32(0)) // granule * granule


@cute.jit
def slot_holds_token(j: Int32, n: Int32, qlen: Int32, sink: Int32, ring: Int32, recent: Int32):
    """Whether window slot ``j`` holds a token (module docstring; ``recent = max(n - sink - qlen, 0)``)."""
    rel = ring_index(j, qlen, sink, ring)
    return (j < sink + ring) & cutlass.select_(j < sink, j < n, rel < recent)


@cute.jit
def slot_position(j: Int32, qlen: Int32, sink: Int32, ring: Int32):
    """The position in its sequence of the token window slot ``j`` holds (where it holds one)."""
    return Int32(cutlass.select_(j < sink, j, sink + qlen + ring_index(j, qlen, sink, ring)))


@cute.jit
def ring_index(j: Int32, qlen: Int32, sink: Int32, ring: Int32):
    """``(j - sink - qlen) mod ring``: how many tokens after the packed ones a ring slot's token comes."""
    rel = (j - sink - qlen) % ring
    return rel + fsel_i32(rel < 0, ring, 0)  # floor mod


def window_blocks(slots, part, parts):
    """How many of the ``slots``' 16-slot blocks part ``part`` of ``parts`` attends: blocks ``part, part + parts,
    ...`` (the cache decodes' share of the window per work item; block ``i`` of the share starts at slot
    ``BLOCK * (part + parts * i)``)."""
    return (cutlass.max((slots + BLOCK - 1) // BLOCK - part, 0) + parts - 1) // parts


def shared_word_index(slot, element, padded_row: int):
    """Int32 word of a shared K / V row's even ``element`` (rows of ``padded_row`` 16-bit values)."""
    return (slot * padded_row + element) // 2


def fsel_i32(cond, a, b):
    """Int32 ``cond ? a : b``, branch-free."""
    return Int32(cutlass.select_(cond, Int32(a), Int32(b)))


class WindowOperands:
    """Compile time: head_dim, the query rows of a KV head (``foscar.query_rows.QueryRows``: R columns), the
    window's 16-bit dtype."""

    def __init__(self, head_dim: int, query: QueryRows, dtype):
        self.D, self.query, self.R = head_dim, query, query.R
        self.PD = head_dim + ROW_PAD  # elements per shared K / V row
        self.N = query_columns(self.R)
        self.NB = self.N // 8
        self.dtype = dtype
        self.pack = pack_bf16x2 if dtype is cutlass.BFloat16 else pack_f16x2

    def rows_words(self, slots: int) -> int:
        """Int32 words of ``slots`` padded shared rows of K (or V)."""
        return slots * self.PD // 2

    def tiled_mma(self):
        """One warp, m16 x n8 x k16, the window's 16-bit operands, FP32 accumulators: both GEMMs."""
        return cute.make_tiled_mma(warp_mma.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)))

    @cute.jit
    def copy_rows(self, tensors, first, rows_in: Int32, j0: Int32, holds, thread: Int32, threads: cutlass.Constexpr,
                  slots: cutlass.Constexpr, unrolled: cutlass.Constexpr = True):
        """``threads`` threads (this one ``thread``): ``cp.async`` of ``slots`` rows, slot ``j0``'s first
        (``first``: its element in each source), of each ``(shared rows, source)`` pair of ``tensors``
        (Int32 shared pointer, 16-bit global pointer) into the padded shared rows, 16 bytes per copy,
        no register staging. A row whose slot holds no token (``holds(slot)`` false: past the
        sequence, a ring slot not yet or no longer in use, past the cache row, of which the chunk has
        ``rows_in``) is not read but zero-filled: its P is 0, and zeros keep 0 x V finite. (One bulk
        copy per row was tried: that many small copies made the TMA engine the bottleneck.)
        ``unrolled=False``: a runtime loop, for threads short of registers."""
        tensors = [(rows, cute.recast_ptr(src, dtype=Int32)) for rows, src in tensors]
        copies = slots * (self.D // 8) // threads
        if cutlass.const_expr(unrolled):
            for x in cutlass.range_constexpr(copies):
                self.copy_piece(tensors, first, rows_in, j0, holds, thread + x * threads)
        else:
            for x in cutlass.range(copies, unroll=1):
                self.copy_piece(tensors, first, rows_in, j0, holds, thread + x * threads)

    @cute.jit
    def copy_piece(self, tensors, first, rows_in: Int32, j0: Int32, holds, piece):
        """Piece ``piece`` (row-major over the slots' 16-byte pieces) of each of ``tensors`` (``copy_rows``)."""
        pieces = self.D // 8  # 16-byte pieces per row
        r, c = piece // pieces, piece % pieces
        for rows, src_words in tensors:
            word = (first + cutlass.min(r, rows_in - 1) * self.D) // 2 + 4 * c
            cp_async_16(rows + cute.assume(r * (self.PD // 2) + 4 * c, divby=4),
                        src_words + cute.assume(word, divby=4), fsel_i32(holds(j0 + r), 16, 0))

    def query_on_demand(self, mma, q: cute.Pointer, q_row0: Int64, kv_heads: Int32):
        """Q^T as B fragments indexed ``[nb][kb]`` like :meth:`query_fragments`' list, each loaded from ``q`` when
        indexed (registers for one fragment, not D/16 x NB of them)."""
        return _QueryOnDemand(self, mma, cute.recast_ptr(q, dtype=Int32), q_row0, kv_heads)

    def row_word(self, rows: cute.Pointer, slot, element):
        """The 32-bit shared word of K or V rows (Int32 pointer) at (slot, even element): two 16-bit values."""
        return cute.make_tensor(rows + shared_word_index(slot, element, self.PD), cute.make_layout((1,)))[0]

    @cute.jit
    def query_fragments(self, mma, q: cute.Pointer, q_row0: Int64, kv_heads: Int32):
        """Q^T as B fragments, [nb][kb]: value e + 2*hh = channel 16*kb + 2*tq + e + 8*hh of query column
        8*nb + g (zeros past the R rows; ``q_row0``: column 0's row of q)."""
        q_words = cute.recast_ptr(q, dtype=Int32)
        q_t = []
        for nb in cutlass.range_constexpr(self.NB):
            col, qrow = self.query_column(mma, q_row0, kv_heads, nb)
            q_t.append([self.query_fragment(mma, q_words, col, qrow, kb) for kb in range(self.D // 16)])
        return q_t

    def query_column(self, mma, q_row0: Int64, kv_heads: Int32, nb: int):
        """(query column of the lane's B-fragment values in n8 block ``nb``, its row of q)."""
        col = 8 * nb + mma.g
        return col, q_row0 + self.query.offset(cutlass.min(col, self.R - 1), kv_heads)

    def query_fragment(self, mma, q_words: cute.Pointer, col, qrow, kb: int):
        """The B fragment of k16 block ``kb`` of the lane's query column ``col`` (row ``qrow`` of q, as Int32 words)."""
        D, R = self.D, self.R
        frag = mma.fragment_B()
        regs = cute.recast_tensor(frag, Int32)
        for hh in range(2):
            word = cute.make_tensor(q_words + (qrow * D + 16 * kb + 2 * mma.tq + 8 * hh) // 2, cute.make_layout((1,)))[0]
            regs[hh] = cutlass.select_(col < R, word, Int32(0))
        return frag

    @cute.jit
    def scores(self, mma, k_rows: cute.Pointer, slot0, q_t, scale_log2: Float32, valid, visible=None,
               unrolled: cutlass.Constexpr = True):
        """S^T of the 16 slots from ``slot0`` of the shared K rows (log2 domain; -inf where ``valid[h_r]``
        is false, or ``visible(nb, i)``, if given, is): NB accumulator values ``i = 4*nb + e + 2*h_r`` = slot
        ``slot0 + g + 8*h_r``, query column ``8*nb + 2*tq + e``. ``unrolled=False``: a runtime loop over the k16
        blocks, for threads short of registers (``q_t`` then indexed by a runtime ``kb``)."""
        acc = [mma.zero_accumulator() for _ in range(self.NB)]
        if cutlass.const_expr(unrolled):
            for kb in cutlass.range_constexpr(self.D // 16):
                self.score_block(mma, k_rows, slot0, q_t, acc, kb)
        else:
            for kb in cutlass.range(self.D // 16, unroll=1):
                self.score_block(mma, k_rows, slot0, q_t, acc, kb)
        s = cute.make_rmem_tensor((4 * self.NB,), Float32)
        for nb in cutlass.range_constexpr(self.NB):
            for i in cutlass.range_constexpr(4):
                keep = valid[i // 2]
                if cutlass.const_expr(visible is not None):
                    keep = keep & visible(nb, i)
                s[4 * nb + i] = fsel(keep, acc[nb][i] * scale_log2, Float32(NEG_INF))
        return s

    def score_block(self, mma, k_rows: cute.Pointer, slot0, q_t, acc, kb):
        """``acc[nb] += K . Q^T`` over k16 block ``kb`` (:meth:`scores`)."""
        a = mma.tiled_mma.make_fragment_A(mma.shape_A)  # K: value e + 2*h_r + 4*h_c, slot g + 8*h_r
        regs = cute.recast_tensor(a, Int32)
        for hr in range(2):
            for hc in range(2):
                regs[hr + 2 * hc] = self.row_word(k_rows, slot0 + mma.g + 8 * hr, 16 * kb + 2 * mma.tq + 8 * hc)
        for nb in range(self.NB):
            mma.gemm(acc[nb], a, q_t[nb][kb])

    @cute.jit
    def probability_fragments(self, mma, p):
        """P^T as B fragments, one per n8 block (``movmatrix`` of the S^T-shaped fp32 ``p``): value
        e + 2*hh = slot 2*tq + e + 8*hh, column 8*nb + g."""
        p_t = []
        for nb in cutlass.range_constexpr(self.NB):
            frag = mma.fragment_B()
            regs = cute.recast_tensor(frag, Int32)
            for hh in cutlass.range_constexpr(2):
                regs[hh] = movmatrix_trans(self.pack(p[4 * nb + 2 * hh], p[4 * nb + 2 * hh + 1]))
            p_t.append(frag)
        return p_t

    @cute.jit
    def value_fragment(self, mma, v_rows: cute.Pointer, slot0, mb: cutlass.Constexpr):
        """V^T of channel block ``mb`` over the 16 slots from ``slot0`` of the shared V rows as an A
        fragment: value e + 2*h_r + 4*h_c = channel 16*mb + g + 8*h_r, slot 2*tq + e + 8*h_c."""
        a = mma.tiled_mma.make_fragment_A(mma.shape_A)
        regs = cute.recast_tensor(a, Int32)
        for hr in cutlass.range_constexpr(2):
            for hc in cutlass.range_constexpr(2):  # lane 4r + c: slot r, channels 2c, 2c + 1; movmatrix transposes
                word = self.row_word(v_rows, slot0 + 8 * hc + mma.g, 16 * mb + 8 * hr + 2 * mma.tq)
                regs[hr + 2 * hc] = movmatrix_trans(word)
        return a


class _QueryOnDemand:
    """:meth:`WindowOperands.query_on_demand`: ``[nb]`` gives the n8 block's column and row of q, ``[nb][kb]``
    loads its k16 fragment."""

    def __init__(self, ops: WindowOperands, mma, q_words: cute.Pointer, q_row0, kv_heads, column=None):
        self.ops, self.mma, self.q_words, self.q_row0, self.kv_heads = ops, mma, q_words, q_row0, kv_heads
        self.column = column

    def __getitem__(self, index: int):
        if self.column is None:
            column = self.ops.query_column(self.mma, self.q_row0, self.kv_heads, index)
            return _QueryOnDemand(self.ops, self.mma, self.q_words, self.q_row0, self.kv_heads, column)
        return self.ops.query_fragment(self.mma, self.q_words, *self.column, index)

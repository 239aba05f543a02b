"""Per-warp ``mma.sync.m16n8k16`` building blocks of the Hopper decode kernel: the warp's fragment
shapes and lane coordinates (:class:`WarpMma`), and the Hopper FP16-mantissa operand construction
from packed codes (:class:`FragmentOperand`, one per tensor: K and V may differ in bits).

Fragment modes (one warp, FP16 in, FP32 accumulate), lane = 4*g + tq:

* A ``((2,2,2),1,1)`` fp16: value ``e + 2*h_r + 4*h_c``, row ``g + 8*h_r``, column ``2*tq + e + 8*h_c``;
* B ``((2,2),1,1)`` fp16: value ``e + 2*hh``, k ``2*tq + e + 8*hh``, n ``g``;
* C ``((2,2),1,1)`` fp32: value ``i = e + 2*h_r``, row ``g + 8*h_r``, column ``2*tq + e``.

Accumulator value ``i`` of n8 block ``nb`` sits in query column ``8*nb + 2*tq + e``: its *column
slot* is ``cs = e + 2*nb`` (NS = 2*NB slots per thread).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..layouts.fragment import THREADS, TileGeometry
from ..operands import HopperRecipe, bias_slot

TOKEN_BLOCKS = 4  # m16 token blocks of a 64-token tile (QK) = k16 token blocks (PV)


class WarpMma:
    """One consumer warp's MMA geometry: the tiled MMA, fragment shapes, and the lane's (g, tq)."""

    def __init__(self, tiled_mma: cute.TiledMma, lane, n_blocks: int):
        self.tiled_mma = tiled_mma
        self.g = lane // 4  # accumulator row (and B column) group
        self.tq = lane % 4  # position in the row group
        thr = tiled_mma.get_slice(lane)
        self.shape_A = thr.partition_shape_A((16, 16))
        self.shape_B = thr.partition_shape_B((8, 16))
        self.shape_C = thr.partition_shape_C((16, 8))
        self.NB = n_blocks  # n8 blocks of query columns
        self.NS = 2 * n_blocks  # column slots per thread

    def column(self, cs: int):
        """Query column of column slot ``cs``."""
        return 8 * (cs // 2) + 2 * self.tq + (cs % 2)

    def fragment_B(self):
        return self.tiled_mma.make_fragment_B(self.shape_B)

    def zero_accumulator(self):
        acc = self.tiled_mma.make_fragment_C(self.shape_C)
        acc.fill(0.0)
        return acc

    def gemm(self, acc, a, b):
        """acc += a x b (in place)."""
        cute.gemm(self.tiled_mma, acc, a, b, acc)

    def chain(self, init, pairs):
        """init + sum of A x B over the (A, B) fragment ``pairs``, in a new accumulator.

        ``init`` is copied first (free: HMMA reads C and writes D in different registers): the DSL's
        warp-MMA gemm writes its result into C's registers when D and C differ, which would clobber
        ``init``."""
        acc = self.tiled_mma.make_fragment_C(self.shape_C)
        acc.store(init.load())
        for a, b in pairs:
            cute.gemm(self.tiled_mma, acc, a, b, acc)
        return acc

    def to_columns(self, per_head, e: int):
        """Value of accumulator column 2*tq + e (of an n8 block) from a per-lane value that lane 4*g
        holds for B-fragment column (query head) g of the same block."""
        return cute.arch.shuffle_sync(per_head, offset=4 * (2 * self.tq + e))

    @staticmethod
    def reduce_over_tq(x):
        """Sum over the 4 lanes of a row group (lane bits 0..1: the k pairs of a B fragment)."""
        for offset in (1, 2):
            x = x + cute.arch.shuffle_sync_bfly(x, offset=offset)
        return x


class FragmentOperand:
    """Hopper operand construction of one tensor: packed codes of a tile (the mma A-fragment order of
    ``foscar.layouts.fragment``) -> f16x2 A fragments ``bias + c/2^bits`` (one LOP3 per register),
    and the constant ``-bias`` fragments whose MMA cancels the bias inside the accumulator
    (``foscar.operands``). What the plan folds is ``c/2^bits``: the construction ``a = 1/2^bits``."""

    def __init__(self, role: str, bits: int, head_dim: int):
        self.geom = TileGeometry(role, bits, head_dim)
        self.words = self.geom.words  # int32 words per packed 64-token tile
        self.words_per_thread = self.geom.words_per_thread  # per virtual thread (128 per tile)
        self.vector_words = self.geom.vector_words
        self.regs_per_word = 16 // bits
        self.slots = HopperRecipe(bits).slots  # per register slot: shift, mask, magic, bias

    def load_words(self, c_ptr, vthread):
        """The packed words of virtual thread ``vthread`` (0..127) of a tile in shared memory: vector
        j at tile vector j*128 + vthread (16-byte ld.shared, a warp's lanes on consecutive vectors)."""
        cw, wpt = self.vector_words, self.words_per_thread
        base = cute.make_tensor(c_ptr, cute.make_layout((cw, THREADS, wpt // cw), stride=(1, cw, THREADS * cw)))
        src = base[None, vthread, None]  # (CW, J)
        dst = cute.make_rmem_tensor((cw, wpt // cw), Int32)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=32 * cw)
        cute.copy(atom, src, dst)
        return cute.make_tensor(dst.iterator, cute.make_layout((wpt,)))

    def a_fragment(self, mma: WarpMma, words, n0: int):
        """A fragment (fp16 m16 x k16) of fragment registers n0..n0+3 of a virtual thread's words."""
        frag = mma.tiled_mma.make_fragment_A(mma.shape_A)
        regs = cute.recast_tensor(frag, Int32)
        for r in range(4):
            n = n0 + r
            regs[r] = _slot_operand(words[n // self.regs_per_word], self.slots[n % self.regs_per_word])
        return frag

    def bias_fragment(self, mma: WarpMma, k_block: int):
        """Constant A fragment of -bias for k16 block ``k_block``: its MMA with a B operand is minus
        what the operand biases of that block add to the accumulator (exact: powers of two)."""
        frag = mma.tiled_mma.make_fragment_A(mma.shape_A)
        regs = cute.recast_tensor(frag, Int32)
        for r in range(4):
            regs[r] = Int32((self.slots[bias_slot(self.regs_per_word, k_block, r)].magic | 0x80008000) - (1 << 32))
        return frag

    def cancel_bias(self, mma: WarpMma, acc, b_frags, k_blocks):
        """acc -= sum over ``k_blocks`` of bias x B (in place): cancels what the operand biases of
        those k16 blocks add to an accumulator of the same B operand."""
        for kb in k_blocks:
            mma.gemm(acc, self.bias_fragment(mma, kb), b_frags[kb])


def _slot_operand(word, slot):
    """f16x2 operand ``bias + c/2^bits`` of a slot's two codes: ((word >> shift) & mask) | magic,
    one LOP3 (the shift by 6 is shared by the word's top slots; the compiler keeps one).

    The AND and the OR are fused explicitly (LUT 0xEA = (a & b) | c): left to itself the compiler
    emits two LOP3s.
    """
    w = cutlass.Uint32(word)
    x = w >> slot.shift if slot.shift else w
    return Int32(cute.arch.lop3(cutlass.Uint32(x), cutlass.Uint32(slot.mask), cutlass.Uint32(slot.magic), 0xEA))

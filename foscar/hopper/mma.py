"""The Hopper decode kernel's operand construction from packed codes (:class:`FragmentOperand`, one per
tensor: K and V may differ in bits), on the per-warp MMA geometry of ``foscar.warp_mma``.
"""

from __future__ import annotations

from fractions import Fraction

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from ..layouts.fragment import THREADS, TileGeometry
from ..operands import HopperRecipe, bias_slot, cancel_word
from ..warp_mma import WarpMma

TOKEN_BLOCKS = 4  # m16 token blocks of a 64-token tile (QK) = k16 token blocks (PV)


class FragmentOperand:
    """Hopper operand construction of one tensor: packed codes of a tile (the mma A-fragment order of
    ``foscar.layouts.fragment``) -> f16x2 A fragments ``bias + c/2^bits`` (one LOP3 per register),
    and the constant ``-(bias - b)`` fragments whose MMA cancels the bias inside the accumulator
    (``foscar.operands``). What the plan folds is ``c/2^bits + b``: the fold's construction ``a = 1/2^bits``,
    ``b`` 0 or, for centred codes, ``-centre/2^bits``."""

    def __init__(self, role: str, bits: int, head_dim: int, offset: Fraction = Fraction(0)):
        self.geom = TileGeometry(role, bits, head_dim)
        self.words = self.geom.words  # int32 words per packed 64-token tile
        self.words_per_thread = self.geom.words_per_thread  # per virtual thread (128 per tile)
        self.vector_words = self.geom.vector_words
        self.regs_per_word = 16 // bits
        self.slots = HopperRecipe(bits).slots  # per register slot: shift, mask, magic, bias
        self.cancel = [cancel_word(slot.bias, offset) for slot in self.slots]  # per slot: f16x2 -(bias - b)

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
        """Constant A fragment of -(bias - b) for k16 block ``k_block``: its MMA with a B operand is minus what the
        operand biases of that block add to the accumulator, plus b times the B operand (exact FP16 constants)."""
        frag = mma.tiled_mma.make_fragment_A(mma.shape_A)
        regs = cute.recast_tensor(frag, Int32)
        for r in range(4):
            word = self.cancel[bias_slot(self.regs_per_word, k_block, r)]
            regs[r] = Int32(word - (1 << 32) if word >= 1 << 31 else word)
        return frag

    def cancel_bias(self, mma: WarpMma, acc, b_frags, k_blocks):
        """acc -= sum over ``k_blocks`` of (bias - b) x B (in place): cancels what the operand biases of
        those k16 blocks add to an accumulator of the same B operand, leaving ``c/2^bits + b``."""
        for kb in k_blocks:
            mma.gemm(acc, self.bias_fragment(mma, kb), b_frags[kb])


def _slot_operand(word, slot):
    """f16x2 operand ``bias + c/2^bits`` of a slot's two codes: ((word >> shift) & mask) | magic, or
    ``word << -shift`` for a negative shift, then one LOP3 (the shift right by 6 is shared by the word's top slots,
    the shift left by 6 by its bottom ones; the compiler keeps one of each).

    The AND and the OR are fused explicitly (LUT 0xEA = (a & b) | c): left to itself the compiler
    emits two LOP3s.
    """
    w = cutlass.Uint32(word)
    x = w >> slot.shift if slot.shift > 0 else (w << -slot.shift if slot.shift < 0 else w)
    return Int32(cute.arch.lop3(cutlass.Uint32(x), cutlass.Uint32(slot.mask), cutlass.Uint32(slot.magic), 0xEA))

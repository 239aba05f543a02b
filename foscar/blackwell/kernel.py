"""Blackwell (sm_100a) fused decode attention over a paged INT2/INT4 KV cache (affine folding).

Same algorithm, plan and cache tensors as ``foscar.hopper`` (``foscar.folds``: the four folding cases);
only the arch parts differ. One CTA = one (split, kv_head, batch); it walks its token range in
*steps* of 128 tokens (two 64-token packed tiles), swap-AB so the cache is the tcgen05 A operand
(M = 128 tokens for QK, M = 128 channels per m-tile for PV) and the query heads are N:

    S^T [128 tokens   x NQK] = K_step  [128 x D]   . Q'^T [D x NQK]    (acc in TMEM)
    O^T [128 channels x NM]  = V^T_step[128 x 128] . P'^T [128 x NM]   (acc in TMEM, per m-tile)

A (K, V^T) is built in shared memory from packed codes by the preparation warpgroup
(``foscar.layouts.blackwell`` word order, ``foscar.blackwell.operands`` recipes: INT2 -> FP4 E2M1
``c/2``, INT4 -> FP8 E4M3 ``c*2^-9``, 3 ALU instructions per word). ``kind::f8f6f4`` reads FP4
from shared memory only in the padded ``b4x16_p64`` form (16 nibbles in 8 bytes + 8 bytes of
padding per 16-byte unit; CUTLASS ``float_e2m1_unpacksmem_t``): the A buffers are laid out and
described as one byte per element (``OPERAND_SMEM_DTYPE``), each word's 8 bytes go to the first
half of its 16-byte unit, and only the instruction descriptor says E2M1 (``tiled_mma`` built with
the FP4 type; descriptors from ``desc_mma`` built with a byte type).

B (Q'^T or P'^T, FP8 E4M3) is split in pieces: columns 0..N-1 hold ``fp8(x)``, N..2N-1
``fp8(x - fp8(x))``, and so on (``NM = PIECES x N``), so one MMA carries ~4 mantissa bits per piece:
hi/lo (~8 bits) for BF16 q, four for FP16 q (``primitives.fp8_piece_options``). Every B value is scaled by
an exact power of two first so its magnitude is below 256 (E4M3 max 448, subnormals from 2^-9):
Q per query row into [128, 256); Q'[r, d] = Q[r, d] * s[d, t] * 2^-e_t with 2^e_t > max_d s[d, t];
P'= P * s[l, j] * 2^-e_j (max over the step's tokens) for token-wise V, P * 2^7 for channel-wise
V (P <= 1). The construction's ``a`` (1/2 or 2^-9) and all those powers of two are undone after
the MMA, in FP32, exactly.

The four folding cases, per step (their hooks: ``foscar.blackwell.folds``; the kernel never
branches on the case):
  * K token-wise: one accumulator per channel block j (N = NM); S = sum_j s'[l,j] S_j + z Qsum.
  * K channel-wise: one MMA with N = NTK*NM: Q' per token group t side by side along N; thread
    (token) l reads the NM columns of its group t(l) and adds C[t] = sum_d z[d,t] q[d].
  * V token-wise: P' per channel block j (one B stage each), one accumulator per (m-tile, j);
    the offset term sum_l z[l,j] P[l] is accumulated per softmax thread (in shared memory).
  * V channel-wise: one accumulator per (m-tile, token group t) over that group's k-blocks; the
    output warpgroup adds s[d,t] * acc_t + z[d,t] * Psum[t].
head_dim 64 uses the M = 128 layouts with V^T rows 64..127 unused (never written, never read).

Warp roles (512 threads), registers rebalanced with setmaxnreg:
  * WG0, warp 0: TMEM allocation, tcgen05.mma issue, tcgen05.commit -> mbarriers.
  * WG0, warp 1: bulk-copy producer of the tile ring.
  * WG1 (prep): packed words from the ring -> FP4/FP8 A operands in smem; Q'^T (hi/lo).
  * WG2 (softmax): S from TMEM (tcgen05.ld, thread = token), K corrections in FP32, online
    softmax (log2 domain), P'^T hi/lo to smem, V offset terms.
  * WG3 (output): PV from TMEM (thread = channel), V scales/corrections, rescale-and-accumulate O
    in registers, epilogue.

Pipeline (``foscar.blackwell.pipeline``: hand-rolled (full, empty) mbarrier pairs per stage):
  * ring (RING tiles): warp 1 of WG0 issues, per 64-token tile, 1-D ``cp.async.bulk`` copies of
    the K codes, V codes, K params and V params (each contiguous) with ``mbarrier.expect_tx``;
    released by prep (codes, channel-wise K params) and softmax (token-wise params, channel-wise
    V params) = 256 arrivals. The output WG runs a step behind, so it does not read the ring: the
    softmax copies the step's channel-wise V (scale, offset) rows (ring -> registers before its
    ring release, registers -> sVp[P buffer] after ``wait_empty(st_ch)``) and hands them over
    with the statistics below.
  * operands (OP_STAGES): prep -> MMA (128 arrivals after ``fence.proxy.async``); freed by a
    ``tcgen05.commit`` after the step's PV.
  * S (S_STAGES TMEM buffers): commit -> softmax; freed right after the ``tcgen05.ld``.
  * P (P_BUFS smem buffers): softmax -> MMA; freed by commit after the PV. The per-step softmax
    statistics (alpha, P unscale, Psum) and channel-wise V params (sVp) travel softmax -> output
    in the same number of buffers (st_ch: the output's release of buffer sp is what the softmax
    waits for before rewriting it, its full wait is what orders the reads after the writes).
  * Before the role dispatch only compile-time values and the barrier/TMEM set-up are computed:
    the token range and the TMEM address are recomputed per role (no register live across it).
  * O (O_STAGES TMEM buffers): commit -> output; freed right after the ``tcgen05.ld``.
The MMA warp issues QK(i) before PV(i-1), so S(i) is ready when the softmax finishes P(i-1). Stage
counts come from the smem and TMEM budgets (``BlackwellConfig``). Output format as Hopper:
``o [B, Hq, D]`` (q dtype) + ``lse [B, Hq]``, or fp32 partials ``o [B, Hq, S, D]``, ``lse [B, Hq, S]``.

Coverage: all four folding cases, INT2 and INT4 for K and V independently (FP4 or FP8 A operands
per tensor), head_dim 64/128/256, any group size of the Scheme, gqa_ratio <= 16 (N = 8 or 16),
page sizes 64/128/256. Shared-memory offsets: ``foscar.blackwell.storage``.
"""

from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float8E4M3FN, Float16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.pipeline import NamedBarrier

from ..barriers import BlackwellDecodeBarrier
from ..decode_kernel import DecodeArgs, DecodeKernelBase, StageLayout
from ..device import NEG_INF, check_register_budget, fsel, launch_regs, set_warpgroup_registers
from ..query_rows import KvHead, Output, QueryRows
from ..jit import half_type
from ..layouts.fragment import TILE_TOKENS
from ..pipeline import Channel, PackedPages
from ..softmax import fast_exp2, normalize, online_update
from ..quantize import check_page_size
from ..scheme import Scheme
from . import pipeline as pl
from . import storage as sm_
from .folds import hooks_for
from .operands import recipe_for
from .pipeline import tcgen05_fence_after, tcgen05_fence_before
from .primitives import STEP, WG, fabs, fp8_piece_options, fp8_pieces, max4, pow2_scale, scalar
from .sequence import STEP_TILES, DecodeSequence
from .window import cache_bytes

# warpgroup roles
WG_MMA, WG_PREP, WG_SOFTMAX, WG_OUTPUT = 0, 1, 2, 3
# registers per thread of each role after setmaxnreg: together the launch's allotment (128 per thread for 512
# threads), the MMA and prep warpgroups' decreases freeing what the softmax and output warpgroups' increases take
REGS = {WG_MMA: 80, WG_PREP: 112, WG_SOFTMAX: 160, WG_OUTPUT: 160}
OPERAND_SMEM_DTYPE = Float8E4M3FN  # one byte per A element in smem (FP4: b4x16_p64 padded form)
SMEM_BUDGET = 227 * 1024 - 2048  # sm_100 dynamic shared memory per CTA, minus a margin


class BlackwellConfig(StageLayout):
    """Static configuration derived from a Scheme's sm_100a plan and a page size (compile-time).

    Per tensor it reads the plan's fold case (``plan.k``, ``plan.v``: group, bits, construction,
    params geometry) and the operand recipe of its bits (``foscar.blackwell.operands``), so K and
    V may differ in bits (FP8 K operands with FP4 V operands, or the reverse). ``tokens``: query tokens per
    sequence (``foscar.query_rows``: gqa x tokens query columns; the cache decode's window blocks mask them,
    or, with ``packed_causal`` (``decode_paged``: the query tokens are the packed pages' last), the packed
    steps). ``window``: the cache decode's 16-bit window blocks (``foscar.window_tiles.WindowOperands``), whose
    shared memory (``foscar.blackwell.window``) comes out of the ring's budget."""

    def __init__(self, scheme: Scheme, page_size: int, split: bool, tokens: int = 1, packed_causal: bool = False,
                 window=None):
        check_page_size(scheme, page_size)
        if not 1 <= scheme.gqa_ratio <= 16:
            raise NotImplementedError("the Blackwell kernel supports gqa_ratio 1..16")
        self.scheme = scheme
        self.plan = scheme.plan("sm_100a")
        self.kfold, self.vfold = self.plan.k, self.plan.v
        self.page_size = page_size
        self.split = bool(split)
        self.D = scheme.head_dim
        self.rows = QueryRows(scheme.gqa_ratio, tokens)
        self.R = self.rows.R  # query columns: gqa x tokens
        self.packed_causal = bool(packed_causal) and tokens > 1
        self.N = 8 if self.R <= 8 else 16  # query columns (padded)
        # operand recipes and constructions, per tensor: the construction's 1/a (an exact power of
        # two) is applied after the MMA
        self.k_op, self.v_op = recipe_for(self.kfold), recipe_for(self.vfold)
        self.k_a_inv, self.v_a_inv = self.kfold.scale_factor, self.vfold.scale_factor
        self.SUB = page_size // TILE_TOKENS
        self.DM = min(self.D, 128)  # channels per m-tile of V^T
        self.MT = self.D // self.DM
        self.KB_D = self.D // 32  # MMA k-blocks (K = 32) over head_dim
        self.KB_S = STEP // 32  # over a step's tokens
        # the fold cases' device hooks (foscar.blackwell.folds) and the geometry they add
        self.kh, self.vh = hooks_for(self.kfold, self), hooks_for(self.vfold, self)
        self.NJK = self.kh.s_blocks  # S accumulators per step (channel blocks; 1 for channel-wise K)
        self.JPM = self.vh.accumulators  # PV accumulators per m-tile (channel blocks or token groups)
        self.P_STAGES = self.vh.p_stages  # P'^T copies per step (token-wise V: one per channel block)
        if self.N > sm_.N_MAX or self.kh.q_copies > sm_.MAX_STEP_GROUPS or self.P_STAGES > sm_.N_MAX:
            raise NotImplementedError(f"{scheme.name}: beyond the shared-memory areas of foscar.blackwell.storage")
        # TMEM: S and O double-buffered where the 512 columns allow (S first: the softmax is the
        # longest role, so the next QK should not wait for it); the B operands in the most FP8 pieces
        # that fit (primitives.fp8_piece_options: FP16 wants more than hi/lo)
        for pieces, ss, os_ in ((p, ss, os_) for p in fp8_piece_options(scheme.q_dtype)
                                for ss, os_ in ((2, 2), (2, 1), (1, 2), (1, 1))):
            self.PIECES = pieces
            self.NM = pieces * self.N  # PV MMA N: P' in its pieces (hi, lo, ...)
            self.NQK = self.kh.q_copies * self.NM  # QK MMA N: one Q' (its pieces) per channel-wise K token group
            self.S_COLS = self.NJK * self.NQK
            self.O_COLS = self.MT * self.JPM * self.NM
            if ss * self.S_COLS + os_ * self.O_COLS <= 512:
                break
        else:
            raise NotImplementedError(f"{scheme.name}: needs {self.S_COLS + self.O_COLS} TMEM columns")
        self.S_STAGES, self.O_STAGES = ss, os_
        self.tmem_cols = max(32, 1 << (ss * self.S_COLS + os_ * self.O_COLS - 1).bit_length())
        self.q_dtype = half_type(scheme.q_dtype)
        self.threads = 4 * WG
        self.launch_regs = launch_regs(self.threads)
        check_register_budget("Blackwell decode", list(REGS.values()), self.launch_regs)
        self.window = window
        # ---- ring of bulk-copied 64-token tiles (int32 words): K codes | V codes | K params | V params.
        # Channel-wise V params are consumed by the output warpgroup, which runs a step behind the
        # others: the softmax warpgroup copies the step's (scale, offset) rows from the ring into a
        # small smem area (sVp, one buffer per P buffer) handed over with alpha / Psum (st_ch), so
        # the ring stages are released as early as before.
        self.lay_out_stage(self.plan, self.k_op.words, self.v_op.words)  # foscar.decode_kernel
        # ---- stage counts from the shared-memory budget: operand stages (prep -> MMA), P stages
        # (softmax -> MMA, with the per-step softmax statistics for the output WG), ring tiles
        # (producer -> prep + softmax). Upgraded in order of benefit while they fit.
        self.OP_STAGES, self.P_BUFS, self.RING = 1, 1, 2
        if self.smem_bytes() > SMEM_BUDGET:
            raise NotImplementedError(f"{scheme.name}: {self.smem_bytes()} B of shared memory")
        # two operand stages double the prep warpgroup's hoisted store addresses: with 8 K + V
        # vectors per thread per tile (INT4, head_dim 256) that spills, so those keep one operand stage
        op2 = () if (self.k_op.vectors + self.v_op.vectors) // WG >= 8 else (("OP_STAGES", 2),)
        # the cache decode (``window``) keeps a power-of-two ring: with 6 stages (their modulo arithmetic) it
        # spilled 40 B (INT4 token-wise groups of 256, head_dim 256, gqa 7, pages of 64), the decode does not
        ring_6 = (("RING", 6),) if window is None else ()
        for attr, val in (*op2, ("RING", 4), ("P_BUFS", 2), *ring_6, ("RING", 8)):
            old = getattr(self, attr)
            setattr(self, attr, val)
            if self.smem_bytes() > SMEM_BUDGET:
                setattr(self, attr, old)

    def smem_words(self) -> dict:
        """Elements of each small shared-memory area (``foscar.blackwell.storage``; 1 where unused)."""
        return {
            "sQinfo": sm_.qinfo_words(self.NJK),
            "sKinfo": sm_.KINFO * self.OP_STAGES,
            "sQf": max(1, self.kh.qf_words),
            "sZ": sm_.MAX_STEP_GROUPS * self.D,
            "sAlpha": sm_.ALPHA_WORDS * self.P_BUFS,
            "sPsum": sm_.PSUM_WORDS * self.P_BUFS,
            "sRed": 2 * sm_.red_words(self.P_STAGES),
            "sRedP": sm_.PREP_RED_WORDS,
            "sCorr": max(1, self.vh.corr_words),
            "sFinal": sm_.final_words(self.P_STAGES),
            "sVp": max(1, self.P_BUFS * self.vh.vp_words),
        }

    def smem_bytes(self) -> int:
        """Shared memory of the kernel's SharedStorage (upper estimate, 1 KB alignment per buffer)."""
        def al(x):
            return (x + 1023) // 1024 * 1024

        q_stages = self.kh.q_buffers(self.OP_STAGES)
        operands = self.OP_STAGES * (al(STEP * self.D) + al(self.MT * STEP * STEP)) + q_stages * al(self.NQK * self.D)
        p = self.P_BUFS * (al(self.NM * STEP * self.P_STAGES) + 4 * (sm_.ALPHA_WORDS + sm_.PSUM_WORDS))
        ring = al(self.RING * self.TILE_BYTES)
        corr = self.vh.corr_words * 4
        misc = self.kh.qf_words * 4 + sm_.MAX_STEP_GROUPS * self.D * 4 + 2 * 4 * sm_.red_words(self.P_STAGES) + 4096
        vp = self.P_BUFS * self.vh.vp_words * 4
        window = 0 if self.window is None else cache_bytes(self.window)
        return operands + p + ring + corr + misc + vp + self.OP_STAGES * 4 * sm_.KINFO + window



def _swizzle(off, b: int, m: int, s: int):
    """CuTe Swizzle<b, m, s> of an offset: bits [m+s, m+s+b) XORed into [m, m+b)."""
    mask = ((1 << b) - 1) << (m + s)
    return off ^ ((off & mask) >> s)


def _t2r(tmem_ptr, acc_layout, t, nm: int):
    """TMEM -> registers copy of one accumulator row per thread (lane t of a warpgroup), nm fp32 columns."""
    atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(nm)), Float32)
    t2r = tcgen05.make_tmem_copy(atom, cute.make_tensor(tmem_ptr, acc_layout)[(None, None), 0, 0])
    return t2r, t2r.get_slice(t)


def _store_chunk(base, outer, swz, m, k, stage: int, lo, hi, stage_words=0):
    """8 operand bytes (consecutive K elements of row m from column k) into a swizzled A buffer.

    ``outer``: the ((128,32),1,KB,STAGE) byte layout, ``swz`` its swizzle, ``base`` the buffer as an
    Int32 pointer. FP8: 8 elements; FP4: 16 nibbles = the data half of a b4x16_p64 unit (k % 16 == 0).
    ``stage`` is static; ``stage_words`` a dynamic offset of whole stages (multiples of the swizzle
    atom, so it commutes with the swizzle): the swizzled part stays loop-invariant for ptxas.
    """
    e = cute.crd2idx(((m, k % 32), 0, k // 32, stage), outer)
    e = _swizzle(e, swz.num_bits, swz.num_base, swz.num_shift)
    dst = cute.make_tensor(base + stage_words + e // 4, cute.make_layout((2,)))
    dst[0] = lo
    dst[1] = hi


@dataclass(frozen=True)
class MmaSetup:
    """The tiled MMAs and the shared-memory layouts of their operands (``mmas_and_layouts``): QK, PV, the one
    whose A fragments are the operand buffers' descriptors, and the K, V^T, Q'^T and P'^T layouts."""

    qk: cute.TiledMma
    pv: cute.TiledMma
    desc: cute.TiledMma
    sK: cute.ComposedLayout
    sV: cute.ComposedLayout
    sQ: cute.ComposedLayout
    sP: cute.ComposedLayout


class BlackwellDecodeKernel(DecodeKernelBase):
    """Fused paged INT2/INT4 decode attention for sm_100a (see the module docstring)."""

    arch = "sm_100a"
    # limits (BlackwellConfig): at most 16 query columns, each split into FP8 pieces; sKinfo holds the unscales
    # and corrections of at most 4 channel-wise K groups per 128-token step, so groups of >= 32 tokens
    max_gqa_ratio, page_sizes, min_group = 16, (64, 128, 256), 32

    def __init__(self, cfg: BlackwellConfig):
        super().__init__(cfg)
        self.kh, self.vh = cfg.kh, cfg.vh  # the fold cases' hooks (foscar.blackwell.folds)

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    def mmas_and_layouts(self):
        """The tiled MMAs and shared-memory operand layouts: ``(mma_qk, mma_pv, desc_mma, sK_layout,
        sV_layout, sQ_layout, sP_layout)``.

        A (codes -> FP4/FP8) K-major from smem, B (FP8 hi/lo) K-major, acc F32 in TMEM. The issuing
        MMAs carry the A format (E2M1 or E4M3) in their instruction descriptor; desc_mma describes the
        A buffers byte-wise (the padded FP4 form has 1 byte per element)."""
        cfg = self.cfg

        def mma(a_dtype, n):
            return sm100_utils.make_trivial_tiled_mma(
                a_dtype, Float8E4M3FN, OperandMajorMode.K, OperandMajorMode.K, Float32, tcgen05.CtaGroup.ONE, (STEP, n)
            )

        mma_qk = mma(cfg.k_op.mma_dtype, cfg.NQK)
        mma_pv = mma(cfg.v_op.mma_dtype, cfg.NM)
        desc_mma = mma(OPERAND_SMEM_DTYPE, cfg.NM)
        q_stages = cfg.kh.q_buffers(cfg.OP_STAGES)
        # (MMA, MMA_M, MMA_K, STAGE): K step [128 tokens x D] bytes, one stage per operand stage
        sK_layout = sm100_utils.make_smem_layout_a(desc_mma, (STEP, cfg.NM, cfg.D), OPERAND_SMEM_DTYPE, cfg.OP_STAGES)
        # V^T step [128 channels x 128 tokens] bytes: stage = operand stage * MT + m-tile
        sV_layout = sm100_utils.make_smem_layout_a(desc_mma, (STEP, cfg.NM, STEP), OPERAND_SMEM_DTYPE, cfg.OP_STAGES * cfg.MT)
        # Q'^T [NQK x D] (channel-wise K: one per operand stage) and P'^T [NM x 128 tokens]
        # (stage = P buffer * P_STAGES + token-wise V channel block)
        sQ_layout = sm100_utils.make_smem_layout_b(mma_qk, (STEP, cfg.NQK, cfg.D), Float8E4M3FN, q_stages)
        sP_layout = sm100_utils.make_smem_layout_b(mma_pv, (STEP, cfg.NM, STEP), Float8E4M3FN, cfg.P_BUFS * cfg.P_STAGES)
        return mma_qk, mma_pv, desc_mma, sK_layout, sV_layout, sQ_layout, sP_layout

    def shared_storage(self, sK_layout, sV_layout, sQ_layout, sP_layout):
        """Shared memory (a ``cute.struct``, built from a dict: this module's annotations are strings
        (PEP 563) outside jit functions); the small areas' offsets: ``foscar.blackwell.storage``."""
        cfg = self.cfg
        n_mbar = 2 * (cfg.RING + cfg.OP_STAGES + cfg.S_STAGES + 2 * cfg.P_BUFS + cfg.O_STAGES)
        sizes = cfg.smem_words()
        Align, MemRange = cute.struct.Align, cute.struct.MemRange
        fields = {
            "mbar": MemRange[cutlass.Int64, n_mbar],
            "tmem_addr": MemRange[Int32, 1],
            "ring": Align[MemRange[Int32, cfg.RING * cfg.STAGE_WORDS], 1024],
            "sK": Align[MemRange[OPERAND_SMEM_DTYPE, cute.cosize(sK_layout)], 1024],
            "sV": Align[MemRange[OPERAND_SMEM_DTYPE, cute.cosize(sV_layout)], 1024],
            "sQ": Align[MemRange[Float8E4M3FN, cute.cosize(sQ_layout)], 1024],
            "sP": Align[MemRange[Float8E4M3FN, cute.cosize(sP_layout)], 1024],
            # the small areas, sized in BlackwellConfig.smem_words: sQf q [N, D] fp32 (channel-wise K),
            # sZ z[d, t] of the step (channel-wise K), sRed softmax x2 by step parity, sRedP prep,
            # sCorr token-wise V offset terms, sVp channel-wise V (scale, offset) fp16 pairs per P buffer
            **{name: Align[MemRange[Int32 if name == "sVp" else Float32, size], 16] for name, size in sizes.items()},
        }
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def launch_decode(self, args: DecodeArgs, grid, stream: cuda.CUstream):
        """Launch the CTAs of ``grid`` (split, KV head, sequence) over ``args``."""
        mmas = self.mmas_and_layouts()
        SharedStorage = self.shared_storage(*mmas[3:])
        self.launch(self.kernel(*mmas, SharedStorage, args), grid, SharedStorage.size_in_bytes(), stream)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, desc_mma: cute.TiledMma,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr, args: DecodeArgs):
        split, h, b = cute.arch.block_idx()
        pages = args.pages
        seq = DecodeSequence(pages.page_table, args.lengths, pages.max_pages, b, split, args.num_splits)
        self.run(MmaSetup(mma_qk, mma_pv, desc_mma, sK_layout, sV_layout, sQ_layout, sP_layout), SharedStorage, args.q,
                 pages, Output(args.o, args.lse, self.cfg.split, split, seq.partials()), KvHead(b, h, args.kv_heads),
                 args.scale_log2, seq)

    @cute.jit
    def run(self, mmas: MmaSetup, SharedStorage, q_ptr: cute.Pointer, pages: PackedPages, out: Output, head: KvHead,
            scale_log2: Float32, seq):
        """The CTA of ``head``, writing ``out`` (its sequence's split: ``seq``, ``foscar.blackwell.sequence``):
        shared memory, barriers, TMEM, then the four roles."""
        cfg = self.cfg
        NM, D = cfg.NM, cfg.D
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        role = warp // 4
        t = tidx % WG  # thread within its warpgroup
        lane = tidx % 32
        wq = (tidx // 32) % 4  # warp within its warpgroup

        # ---------------------------------------------------------------- shared memory
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sizes = cfg.smem_words()
        # the named tensors every role and fold hook reads (offsets: foscar.blackwell.storage)
        sm = sm_.Smem(
            sK=storage.sK.get_tensor(mmas.sK.outer, swizzle=mmas.sK.inner),  # (MMA, MMA_M, MMA_K, OP_STAGES)
            sV=storage.sV.get_tensor(mmas.sV.outer, swizzle=mmas.sV.inner),  # (MMA, MMA_M, MMA_K, OP_STAGES*MT)
            sQ=storage.sQ.get_tensor(mmas.sQ.outer, swizzle=mmas.sQ.inner),  # (MMA, MMA_N, MMA_K, 1 | OP_STAGES)
            sP=storage.sP.get_tensor(mmas.sP.outer, swizzle=mmas.sP.inner),  # (MMA, MMA_N, MMA_K, P_BUFS*P_STAGES)
            **{name: getattr(storage, name).get_tensor(cute.make_layout(size)) for name, size in sizes.items()},
        )

        # ---------------------------------------------------------------- mbarrier channels
        # (full, empty) mbarrier pairs per stage (foscar.blackwell.pipeline), with arrival counts
        ring = Channel(storage.mbar.data_ptr(), cfg.RING)  # producer (expect_tx) -> prep + softmax: (1, 256)
        opnd = ring.next(cfg.OP_STAGES)  # prep -> MMA (commit after the step's PV): (128, 1)
        s_ch = opnd.next(cfg.S_STAGES)  # MMA (commit) -> softmax, S in TMEM: (1, 128)
        p_ch = s_ch.next(cfg.P_BUFS)  # softmax -> MMA, P'^T in smem: (128, 1)
        st_ch = p_ch.next(cfg.P_BUFS)  # softmax -> output: alpha, P unscale, Psum: (128, 128)
        o_ch = st_ch.next(cfg.O_STAGES)  # MMA (commit) -> output, O partials in TMEM: (1, 128)

        # ---------------------------------------------------------------- barriers + TMEM
        if tidx == 0:
            ring.init(1, 2 * WG)
            opnd.init(WG, 1)
            s_ch.init(1, WG)
            p_ch.init(WG, 1)
            st_ch.init(WG, WG)
            o_ch.init(1, WG)
            cute.arch.mbarrier_init_fence()
        tmem_holder = storage.tmem_addr.data_ptr()
        if warp == 0:
            cute.arch.alloc_tmem(cfg.tmem_cols, tmem_holder)
        cute.arch.sync_threads()

        # ---------------------------------------------------------------- MMA partitions
        s_layout = mmas.qk.make_fragment_C(mmas.qk.get_slice(0).partition_shape_C((STEP, cfg.NQK))).layout
        # ((128, NM), 1, 1)
        acc_layout = mmas.pv.make_fragment_C(mmas.pv.get_slice(0).partition_shape_C((STEP, NM))).layout
        nd = max(1, D // WG)  # channels per thread (head_dim 64: threads t and t+64 share one)
        ch = pl.Channels(ring, opnd, s_ch, p_ch, st_ch, o_ch, storage.ring.data_ptr())

        # ================================================================ roles
        # Nothing dynamic is computed before the dispatch: the TMEM address and the CTA's token range
        # (``seq.tiles()``) are (re)computed inside each role, so no value stays live across it
        # (ptxas spilled such values when one role ran at its setmaxnreg ceiling).
        if role == WG_PREP:
            set_warpgroup_registers(REGS[WG_PREP], cfg.launch_regs)
            self.prep(sm, storage, mmas, ch, q_ptr, seq, head, scale_log2, t, lane, wq, nd)

        if role == WG_MMA:
            set_warpgroup_registers(REGS[WG_MMA], cfg.launch_regs)
            if warp == 1:
                self.produce(ch, pages, seq, head)
            if warp == 0:
                self.issue_mma(mmas, sm, tmem_holder, s_layout, acc_layout, ch, seq)

        if role == WG_SOFTMAX:
            set_warpgroup_registers(REGS[WG_SOFTMAX], cfg.launch_regs)
            self.softmax(sm, ch, seq, t, lane, wq, tmem_holder, acc_layout, nd)

        if role == WG_OUTPUT:
            set_warpgroup_registers(REGS[WG_OUTPUT], cfg.launch_regs)
            self.output(sm, ch, tmem_holder, acc_layout, out, head, seq, t, wq, nd)

        cute.arch.sync_threads()
        if warp == 0:
            cute.arch.dealloc_tmem(cute.arch.retrieve_tmem_ptr(Float32, 16, tmem_holder), cfg.tmem_cols)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def produce(self, ch: pl.Channels, pages: PackedPages, seq, head: KvHead):
        """Producer warp (warp 1): the warp walks the CTA's 64-token tiles, and one elected lane issues the 1-D bulk
        copies of each (K codes, V codes, K params, V params: each contiguous in global memory) into the ring.
        Local tile i = 2*step + half uses ring stage i % RING; a tile past the CTA's range repeats the last tile of
        the sequence (finite codes, masked by the softmax). elect.sync, not `lane == 0`: ptxas then moves the
        copies' operands to uniform registers directly, with no per-copy ELECT / R2UR loop (benchmarks/NOTES.md
        section 48)."""
        cfg = self.cfg
        ring = ch.ring
        tiles = seq.tiles()
        for i in cutlass.range(0, STEP_TILES * tiles.steps(STEP_TILES), 1, unroll=1):
            page, sub, slot0 = self.tile_page(seq, tiles.n_tiles(), tiles.begin + i)
            page_head = page.to(Int64) * head.kv_heads + head.h
            with cute.arch.elect_one():
                st = ring.stage(i)
                ring.wait_empty(i)
                cute.arch.mbarrier_arrive_and_expect_tx(ring.full(st), cfg.TILE_BYTES)
                self.copy_tile(ch.ring_words + cute.assume(st * cfg.STAGE_WORDS, divby=4), ring.full(st), pages,
                               page_head, sub, slot0)

    def tile_page(self, seq, n_tiles, tile):
        """``seq.tile_page`` (a call on the kernel: the DSL takes only the kernel's methods in loops)."""
        return seq.tile_page(n_tiles, tile, self.cfg.page_size)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def issue_mma(self, mmas: MmaSetup, sm, tmem_holder, s_layout, acc_layout, ch: pl.Channels, seq):
        """MMA warp (warp 0). Iteration i issues QK of step i, then PV of step i-1, so the next
        step's S is in TMEM while the softmax warpgroup works on the previous one. The smem
        descriptors are built here (after the role dispatch) and indexed by the dynamic stage, so
        ptxas derives them from a base per step instead of keeping every MMA's descriptor live."""
        cfg = self.cfg
        mma_qk, mma_pv, desc_mma = mmas.qk, mmas.pv, mmas.desc  # (the MMAs' ACCUMULATE field is loop-carried)
        opnd, s_ch, p_ch, o_ch = ch.opnd, ch.s, ch.p, ch.o
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, 16, tmem_holder)
        n_steps = seq.tiles().steps(STEP_TILES)
        sK, sV, sQ, sP = sm.sK, sm.sV, sm.sQ, sm.sP
        tCrK = desc_mma.make_fragment_A(sK)  # descriptors (MMA, 1, KB_D, OP_STAGES)
        tCrV = desc_mma.make_fragment_A(sV)  # (MMA, 1, KB_S, OP_STAGES*MT)
        tCrQ = mma_qk.make_fragment_B(sQ)  # (MMA, 1, KB_D, 1 | OP_STAGES)
        tCrP = mma_pv.make_fragment_B(sP)  # (MMA, 1, KB_S, P_BUFS*P_STAGES)
        # PV(i - lag) after QK(i): lag 1 overlaps the next QK with the softmax; with one operand stage
        # QK(i) needs the stage that PV(i - 1) frees, so lag 0 there (no deadlock).
        lag = 1 if cfg.OP_STAGES > 1 else 0
        for i in cutlass.range(0, n_steps + lag, 1, unroll=1):
            if i < n_steps:
                so = opnd.stage(i)
                ss = s_ch.stage(i)
                opnd.wait_full(i)  # A (K) and Q'^T in smem
                s_ch.wait_empty(i)  # softmax has read S stage ss
                tcgen05_fence_after()
                for j in cutlass.range_constexpr(cfg.NJK):
                    # S^T_j = K[:, block j] . Q'^T[block j, :]  (token-wise K: one accumulator per block j)
                    tS = cute.make_tensor(tmem_ptr + ss * cfg.S_COLS + j * cfg.NQK, s_layout)
                    mma_qk.set(tcgen05.Field.ACCUMULATE, False)
                    for kb in cutlass.range_constexpr(j * cfg.KB_D // cfg.NJK, (j + 1) * cfg.KB_D // cfg.NJK):
                        cute.gemm(mma_qk, tS, tCrK[None, None, kb, so], tCrQ[None, None, kb, self.kh.q_stage(so)], tS)
                        mma_qk.set(tcgen05.Field.ACCUMULATE, True)
                with cute.arch.elect_one():
                    tcgen05.commit(s_ch.full(ss))
            if i >= lag:
                k = i - lag
                so = opnd.stage(k)
                sp = p_ch.stage(k)
                sO = o_ch.stage(k)
                p_ch.wait_full(k)  # P'^T in smem
                o_ch.wait_empty(k)  # output warpgroup has read O stage sO
                tcgen05_fence_after()
                for mt in cutlass.range_constexpr(cfg.MT):
                    for jl in cutlass.range_constexpr(cfg.JPM):
                        # token-wise V: O^T_{mt,j} = V^T[m-tile mt] . (P'^T scaled for channel block j)
                        # channel-wise V: O^T_{mt,t} = V^T[m-tile mt, group t] . P'^T[group t]
                        tO = cute.make_tensor(tmem_ptr + cfg.S_STAGES * cfg.S_COLS + sO * cfg.O_COLS
                                              + (mt * cfg.JPM + jl) * cfg.NM, acc_layout)
                        mma_pv.set(tcgen05.Field.ACCUMULATE, False)
                        for kb in cutlass.range_constexpr(*self.vh.pv_kblocks(jl)):
                            cute.gemm(mma_pv, tO, tCrV[None, None, kb, so * cfg.MT + mt],
                                      tCrP[None, None, kb, sp * cfg.P_STAGES + self.vh.pv_stage(mt, jl)], tO)
                            mma_pv.set(tcgen05.Field.ACCUMULATE, True)
                with cute.arch.elect_one():
                    tcgen05.commit(o_ch.full(sO))
                    tcgen05.commit(p_ch.empty(sp))
                    tcgen05.commit(opnd.empty(so))

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def prep(self, sm, storage, mmas: MmaSetup, ch: pl.Channels, q_ptr: cute.Pointer, seq, head: KvHead,
             scale_log2: Float32, t, lane, wq, nd: cutlass.Constexpr):
        """Preparation warpgroup: Q'^T hi/lo and the K corrections (fold hooks), then per step the
        A operands from packed words."""
        cfg = self.cfg
        N, D, R = cfg.N, cfg.D, cfg.R
        q_base = cfg.rows.row(head.b, head.h, 0, head.kv_heads) * D  # q of the KV head's query column 0
        # ---- q per row, its power-of-two scale; thread t owns channels d = (t + 128*i) % D
        for r in cutlass.range_constexpr(N):
            rr = cfg.rows.offset(min(r, R - 1), head.kv_heads)  # the column's row, from column 0's
            qv = cute.make_rmem_tensor((nd,), Float32)
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(nd):
                d = (t + WG * i) % D
                x = scalar(q_ptr, q_base + rr * D + d)[0].to(Float32)
                qv[i] = x if r < R else Float32(0.0)
                amax = cute.arch.fmax(amax, fabs(qv[i]))
            amax = cute.arch.warp_reduction(amax, cute.arch.fmax)
            if lane == 0:
                sm.sRedP[sm_.red_row(0, r) + wq] = amax
            NamedBarrier(BlackwellDecodeBarrier.PREP, WG).arrive_and_wait()
            sc = pow2_scale(max4(sm.sRedP, sm_.red_row(0, r)))
            self.kh.prep_q_row(sm, qv, sc, r, t, nd)  # Q^T in pieces once (token-wise K) or q kept for Q' per step
            if t == 0:
                sm.sQinfo[sm_.s_unscale(r)] = scale_log2 / sc  # S unscale, log2(e)*sm_scale folded in
                sm.sQinfo[sm_.q_scale(r)] = sc
        self.kh.prep_sums(sm, q_ptr, q_base, head.kv_heads, scale_log2, t)
        NamedBarrier(BlackwellDecodeBarrier.PREP, WG).arrive_and_wait()
        self.prep_operands(sm, storage, mmas, ch, seq, scale_log2, t, lane, wq, nd)

    @cute.jit
    def prep_operands(self, sm, storage, mmas: MmaSetup, ch: pl.Channels, seq, scale_log2: Float32, t, lane, wq,
                      nd: cutlass.Constexpr):
        """Per step: the K hook's per-step work (channel-wise K: Q' and C), then the K and V^T A
        operands from the packed words of the ring, each tensor with its own recipe (bits)."""
        cfg = self.cfg
        ring, opnd, ring_words = ch.ring, ch.opnd, ch.ring_words
        sK_layout, sV_layout = mmas.sK, mmas.sV
        ku32 = cute.recast_ptr(storage.sK.data_ptr(), dtype=Int32)
        vu32 = cute.recast_ptr(storage.sV.data_ptr(), dtype=Int32)
        ksw, vsw = sK_layout.inner, sV_layout.inner
        n_steps = seq.tiles().steps(STEP_TILES)
        for step in cutlass.range(0, n_steps, 1, unroll=1):
            so = opnd.stage(step)
            ring.wait_full(2 * step)  # both tiles of the step in the ring
            ring.wait_full(2 * step + 1)
            opnd.wait_empty(step)  # the MMAs of step - OP_STAGES have read operand stage so
            self.kh.prep_step(self, sm, ring, ring_words, step, so, scale_log2, t, lane, wq, nd)
            k_stage_words = cute.assume(so * (cute.crd2idx(((0, 0), 0, 0, 1), sK_layout.outer) // 4), divby=256)
            v_stage_words = cute.assume(so * (cfg.MT * cute.crd2idx(((0, 0), 0, 0, 1), sV_layout.outer) // 4), divby=256)
            for half in cutlass.range_constexpr(2):
                tile_words = ring_words + cute.assume(ring.stage(2 * step + half) * cfg.STAGE_WORDS, divby=4)
                for is_v in cutlass.range_constexpr(2):
                    recipe = cfg.v_op if is_v else cfg.k_op
                    vec_per_thread = max(1, recipe.vectors // WG)  # 16-byte vectors per thread per tile
                    vt = t % recipe.vectors  # head_dim 64 INT2: threads t and t+64 duplicate one vector
                    # (4 words, thread, vector): vector j of thread t = tile vector j*128 + t
                    src = cute.make_tensor(tile_words + (cfg.V_CODES if is_v else cfg.K_CODES),
                                           cute.make_layout((4, WG, vec_per_thread), stride=(1, 4, 4 * WG)))
                    words = cute.make_rmem_tensor((4, vec_per_thread), Int32)
                    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128)
                    cute.copy(atom, src[None, vt, None], words)
                    cpr = recipe.tile.chunks_per_row
                    E = recipe.elems_per_word
                    for v in cutlass.range_constexpr(vec_per_thread):
                        for wi in cutlass.range_constexpr(4):
                            lo, hi = recipe.build(Uint32(words[wi, v]))
                            n = (v * WG + vt) * 4 + wi  # word of the tile: (row, chunk) row-major
                            row = n // cpr
                            col = (n % cpr) * E
                            if cutlass.const_expr(is_v):  # V^T: row = channel, K mode = token
                                _store_chunk(vu32, sV_layout.outer, vsw, row % cfg.DM, col + TILE_TOKENS * half,
                                             row // cfg.DM, lo, hi, v_stage_words)
                            else:  # K: row = token, K mode = channel
                                _store_chunk(ku32, sK_layout.outer, ksw, row + TILE_TOKENS * half, col, 0, lo, hi,
                                             k_stage_words)
            ring.release(2 * step)
            ring.release(2 * step + 1)
            cute.arch.fence_view_async_shared()  # generic smem writes -> visible to tcgen05 (async proxy)
            opnd.publish(step)

    # ------------------------------------------------------------------------------------------
    # softmax warpgroup (thread = token of the step), in stages
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def softmax(self, sm, ch: pl.Channels, seq, t, lane, wq, tmem_holder, acc_layout, nd: cutlass.Constexpr):
        """Per step: S with the K fold applied (hook), the column max, the V params (hook), the online
        softmax update with P'^T hi/lo and the V terms (hook); then the final reductions."""
        cfg = self.cfg
        N = cfg.N
        ring, s_ch, p_ch, st_ch, ring_words = ch.ring, ch.s, ch.p, ch.st, ch.ring_words
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, 16, tmem_holder)
        t2r, thr_t2r = _t2r(tmem_ptr, acc_layout, t, cfg.NM)
        tiles = seq.tiles()
        length, t_begin, t_end, n_steps = tiles.length, tiles.begin, tiles.end, tiles.steps(STEP_TILES)
        RED = sm_.red_words(cfg.P_STAGES)  # sRed half (by step parity: one barrier per step suffices)
        m_run = cute.make_rmem_tensor((N,), Float32)
        l_run = cute.make_rmem_tensor((N,), Float32)  # per-thread partial (one token per step)
        for r in cutlass.range_constexpr(N):
            m_run[r] = Float32(NEG_INF)
            l_run[r] = Float32(0.0)
        self.vh.softmax_init(sm, t)
        u = t // TILE_TOKENS  # tile of the step holding this thread's token
        for step in cutlass.range(0, n_steps, 1, unroll=1):
            ss = s_ch.stage(step)
            sp = p_ch.stage(step)
            red = (step % 2) * RED
            tile = t_begin + 2 * step + u
            tok = tile * TILE_TOKENS + t % TILE_TOKENS
            ok = (tok < length) & (tile < t_end)
            ring.wait_full(2 * step)  # this step's params (token-wise K and V) are in the ring
            ring.wait_full(2 * step + 1)
            prm = cute.recast_ptr(ring_words + cute.assume(ring.stage(2 * step + u) * cfg.STAGE_WORDS, divby=4),
                                  dtype=Float16)
            self.kh.softmax_wait(ch.opnd, step)
            s_ch.wait_full(step)  # S of this step in TMEM (tcgen05.commit)
            tcgen05_fence_after()
            sc = self.kh.scores(sm, prm, tmem_ptr, t2r, thr_t2r, acc_layout, ss, step, t, wq)
            tcgen05_fence_before()
            s_ch.release(step)  # S stage free for the QK of step + S_STAGES
            self.softmax_column_max(sm, sc, ok, tok, length, red, lane, wq)
            v_params = self.vh.softmax_params(sm, prm, ring_words, step, ok, red, t, lane, wq, nd)
            ring.release(2 * step)  # last ring read of this step (params)
            ring.release(2 * step + 1)
            NamedBarrier(BlackwellDecodeBarrier.SOFTMAX, WG).arrive_and_wait()
            p_ch.wait_empty(step)  # the PV of step - P_BUFS has read P buffer sp
            st_ch.wait_empty(step)  # the output warpgroup has read the statistics of buffer sp
            self.vh.softmax_hand_over(sm, v_params, sp, t, nd)
            self.softmax_update(sm, sc, m_run, l_run, v_params, red, sp, t, lane, wq)
            cute.arch.fence_view_async_shared()  # P'^T (generic stores) -> visible to tcgen05.mma
            p_ch.publish(step)
            st_ch.publish(step)
        NamedBarrier(BlackwellDecodeBarrier.SOFTMAX, WG).arrive_and_wait()  # last step's sRed reads done
        self.softmax_final(sm, m_run, l_run, t, lane, wq)

    @cute.jit
    def softmax_column_max(self, sm, sc, ok, tok, length, red, lane, wq):
        """Mask the tokens past the range (and, with ``packed_causal``, each query row's later tokens: this
        thread's token ``tok`` of the ``length``-token sequence), then per-warp maxima of each query row over
        its tokens (a row that sees none keeps -inf: ``softmax_update`` subtracts a finite reference)."""
        cfg = self.cfg
        for r in cutlass.range_constexpr(cfg.N):
            keep = ok
            if cutlass.const_expr(cfg.packed_causal):
                keep = ok & cfg.rows.sees(r, tok, length)
            sc[r] = fsel(keep, sc[r], Float32(NEG_INF))
            mx = cute.arch.warp_reduction(sc[r], cute.arch.fmax)
            if lane == 0:
                sm.sRed[sm_.red_row(red, r) + wq] = mx

    @cute.jit
    def softmax_update(self, sm, sc, m_run, l_run, v_params, red, sp, t, lane, wq):
        """Online softmax over the step (log2 domain): alpha and the P unscales for the output
        warpgroup, P'^T hi/lo per P stage (the V hook scales P and adds its offset terms)."""
        cfg = self.cfg
        N = cfg.N
        pscale = cute.make_rmem_tensor((cfg.P_STAGES,), Float32)
        for j in cutlass.range_constexpr(cfg.P_STAGES):
            pscale[j] = self.vh.p_scale(sm, red, j)
            if t == 0:
                sm.sAlpha[sm_.p_unscale(sp, j)] = cfg.v_a_inv / pscale[j]  # exact: powers of two
        for r in cutlass.range_constexpr(N):
            m_run[r], alpha, m_use = online_update(m_run[r], max4(sm.sRed, sm_.red_row(red, r)), fast_exp2)
            p = fast_exp2(sc[r] - m_use)
            l_run[r] = l_run[r] * alpha + p
            if t == 0:
                sm.sAlpha[sm_.alpha(sp, r)] = alpha
            for j in cutlass.range_constexpr(cfg.P_STAGES):
                pieces = fp8_pieces(self.vh.p_operand(sm, v_params, p, alpha, pscale, r, j, t), cfg.PIECES)
                for k in cutlass.range_constexpr(cfg.PIECES):
                    sm.sP[((k * N + r, t % 32), 0, t // 32, sp * cfg.P_STAGES + j)] = pieces[k]
            self.vh.softmax_row_done(sm, p, r, sp, lane, wq)

    @cute.jit
    def softmax_final(self, sm, m_run, l_run, t, lane, wq):
        """l (and the V hook's offset terms) reduced over the 128 threads, m: into sFinal for the
        output warpgroup."""
        cfg = self.cfg
        N = cfg.N
        for r in cutlass.range_constexpr(N):
            ls = cute.arch.warp_reduction(l_run[r], lambda a, c: a + c)
            if lane == 0:
                sm.sRed[sm_.red_row(0, r) + wq] = ls
            self.vh.softmax_final_row(sm, r, t, lane, wq)
        NamedBarrier(BlackwellDecodeBarrier.SOFTMAX, WG).arrive_and_wait()
        if t < N:
            r = t
            o = sm_.red_row(0, r)
            sm.sFinal[sm_.final_l(r)] = sm.sRed[o] + sm.sRed[o + 1] + sm.sRed[o + 2] + sm.sRed[o + 3]
            self.vh.softmax_final_store(sm, r)
        for r in cutlass.range_constexpr(N):
            if t == r:
                sm.sFinal[sm_.final_m(r)] = m_run[r]
        NamedBarrier(BlackwellDecodeBarrier.FINAL, 2 * WG).arrive_and_wait()

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def output(self, sm, ch: pl.Channels, tmem_holder, acc_layout, out: Output, head: KvHead, seq, t, wq,
               nd: cutlass.Constexpr):
        """Output warpgroup: thread t owns channels d = t + 128*mt (t < head_dim), all N query rows;
        the V hook applies its scales and offsets to the PV accumulators."""
        cfg = self.cfg
        N = cfg.N
        st_ch, o_ch = ch.st, ch.o
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, 16, tmem_holder)
        t2r, thr_t2r = _t2r(tmem_ptr, acc_layout, t, cfg.NM)
        n_steps = seq.tiles().steps(STEP_TILES)
        accO = cute.make_rmem_tensor((cfg.MT * N,), Float32)
        for x in cutlass.range_constexpr(cfg.MT * N):
            accO[x] = Float32(0.0)
        dt = t % cfg.DM  # head_dim 64: rows 64..127 of the accumulators are unused
        for step in cutlass.range(0, n_steps, 1, unroll=1):
            sO = o_ch.stage(step)
            sp = st_ch.stage(step)
            st_ch.wait_full(step)  # alpha, P unscale, Psum, channel-wise V params of this step (softmax)
            o_ch.wait_full(step)  # PV of this step in TMEM (tcgen05.commit)
            tcgen05_fence_after()
            o_base = tmem_ptr + cfg.S_STAGES * cfg.S_COLS + sO * cfg.O_COLS
            for mt in cutlass.range_constexpr(cfg.MT):
                self.vh.output_accumulate(sm, accO, o_base, mt, mt * cfg.DM + dt, sp, t2r, thr_t2r, acc_layout, wq)
            tcgen05_fence_before()
            o_ch.release(step)  # O stage free for the PV of step + O_STAGES
            st_ch.release(step)
        NamedBarrier(BlackwellDecodeBarrier.FINAL, 2 * WG).arrive_and_wait()
        self.epilogue(sm, ch, accO, out, head, seq, t)

    @cute.jit
    def epilogue(self, sm, ch: pl.Channels, accO, out: Output, head: KvHead, seq, t):
        """Add the V hook's offset term of the channel, normalise by l, write o and the LSE to ``out`` (``ch``,
        ``seq``: the CTA's channels and sequence, which the cache decode's epilogue reads)."""
        cfg = self.cfg
        N, D, R = cfg.N, cfg.D, cfg.R
        o_ptr, lse_ptr = out.o, out.lse  # (``out`` named in an assignment in an `if`: a value the `if` writes)
        for r in cutlass.range_constexpr(N):
            if r < R:
                inv_l, lse = normalize(sm.sFinal[sm_.final_l(r)], sm.sFinal[sm_.final_m(r)])
                obase, lidx = out.offsets(cfg.rows, head, r, D)
                if t == 0:
                    scalar(lse_ptr, lidx)[0] = lse
                if t < cfg.DM:
                    for mt in cutlass.range_constexpr(cfg.MT):
                        d = mt * cfg.DM + t
                        val = self.vh.output_term(sm, accO[mt * N + r], d, r) * inv_l
                        if cutlass.const_expr(cfg.split):
                            scalar(o_ptr, obase + d)[0] = val
                        else:
                            scalar(o_ptr, obase + d)[0] = val.to(cfg.q_dtype)

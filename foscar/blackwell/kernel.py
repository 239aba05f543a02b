"""Blackwell (sm_100a) fused decode attention over a paged INT2/INT4 KV cache (affine folding).

Same algorithm, plan and cache tensors as ``foscar.hopper`` (design.md: the four folding cases);
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

B (Q'^T or P'^T, FP8 E4M3) is hi/lo split: columns 0..N-1 hold ``fp8(x)``, N..2N-1
``fp8(x - fp8(x))`` (``NM = 2N``), so one MMA carries ~8 mantissa bits. Every B value is scaled by
an exact power of two first so its magnitude is below 256 (E4M3 max 448, subnormals from 2^-9):
Q per query row into [128, 256); Q'[r, d] = Q[r, d] * s[d, t] * 2^-e_t with 2^e_t > max_d s[d, t];
P'= P * s[l, j] * 2^-e_j (max over the step's tokens) for token-wise V, P * 2^7 for channel-wise
V (P <= 1). The construction's ``a`` (1/2 or 2^-9) and all those powers of two are undone after
the MMA, in FP32, exactly.

The four folding cases (design.md), per step:
  * K token-wise: one accumulator per channel block j (N = NM); S = sum_j s'[l,j] S_j + z Qsum.
  * K channel-wise: one MMA with N = NTK*NM: Q' per token group t side by side along N; thread
    (token) l reads the NM columns of its group t(l) and adds C[t] = sum_d z[d,t] q[d].
  * V token-wise: P' per channel block j (one B stage each), one accumulator per (m-tile, j);
    the offset term sum_l z[l,j] P[l] is accumulated per softmax thread (in shared memory).
  * V channel-wise: one accumulator per (m-tile, token group t) over that group's k-blocks; the
    output warpgroup adds s[d,t] * acc_t + z[d,t] * Psum[t].
head_dim 64 uses the M = 128 layouts with V^T rows 64..127 unused (never written, never read).

Warp roles (512 threads, design.md), registers rebalanced with setmaxnreg:
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

Coverage: all four folding cases, INT2 and INT4, head_dim 64/128/256, any group size of the
Scheme, gqa_ratio <= 16 (N = 8 or 16), page sizes 64/128/256.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import BFloat16, Float4E2M1FN, Float8E4M3FN, Float16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

from ..device import LN2, LOG2E, NEG_INF, fsel, output_offsets
from ..layouts.blackwell import BlackwellTile
from ..layouts.fragment import TILE_TOKENS
from ..pipeline import bulk_copy_g2s
from ..scheme import Axis, Scheme
from .operands import construction_for
from . import pipeline as pl
from .pipeline import tcgen05_fence_after, tcgen05_fence_before

STEP = 2 * TILE_TOKENS  # tokens per MMA step (M = 128)
WG = 128
# warpgroup roles
WG_MMA, WG_PREP, WG_SOFTMAX, WG_OUTPUT = 0, 1, 2, 3
# registers per thread of each role after setmaxnreg (sum * 128 <= 64K)
REGS = {WG_MMA: 80, WG_PREP: 112, WG_SOFTMAX: 160, WG_OUTPUT: 160}
# named barriers (0 = sync_threads)
BAR_SOFTMAX = 3  # softmax warpgroup internal
BAR_PREP = 4  # preparation warpgroup internal
BAR_FINAL = 5  # softmax + output warpgroups: final reductions done
FP8_TARGET_EXP = 7  # scale hi/lo operands so their max lies in [2^7, 2^8)
OPERAND_SMEM_DTYPE = Float8E4M3FN  # one byte per A element in smem (FP4: b4x16_p64 padded form)
SMEM_BUDGET = 227 * 1024 - 2048  # sm_100 dynamic shared memory per CTA, minus a margin
KINFO = 80  # floats per operand stage of sKinfo (channel-wise K: 4 unscales + 4 x 16 C terms)


class BlackwellConfig:
    """Static configuration derived from a Scheme and a page size (compile-time)."""

    def __init__(self, scheme: Scheme, page_size: int, split: bool):
        import torch

        if page_size not in (64, 128, 256):
            raise ValueError(f"page_size must be 64, 128 or 256, got {page_size}")
        if not 1 <= scheme.gqa_ratio <= 16:
            raise NotImplementedError("the Blackwell kernel supports gqa_ratio 1..16")
        self.scheme = scheme
        self.page_size = page_size
        self.split = bool(split)
        self.bits = scheme.bits
        self.D = scheme.head_dim
        self.R = scheme.gqa_ratio
        self.N = 8 if self.R <= 8 else 16  # query columns (padded)
        self.NM = 2 * self.N  # hi and lo halves
        self.con = construction_for(self.bits)
        self.a_inv = float(1 / self.con.a)  # exact power of two, applied after the MMA
        self.op_dtype = Float4E2M1FN if self.bits == 2 else Float8E4M3FN
        self.ktile = BlackwellTile("k", self.bits, self.D)
        self.TW = self.ktile.words
        self.E = self.ktile.elems_per_word
        self.mask = self.ktile.mask
        self.NV = self.TW // 4  # 16-byte vectors per tile
        self.SUB = page_size // TILE_TOKENS
        self.DM = min(self.D, 128)  # channels per m-tile of V^T
        self.MT = self.D // self.DM
        self.KB_D = self.D // 32  # MMA k-blocks (K = 32) over head_dim
        self.KB_S = STEP // 32  # over a step's tokens
        self.GK, self.GV = scheme.k.group, scheme.v.group
        self.k_token = scheme.k.axis is Axis.TOKEN
        self.v_token = scheme.v.axis is Axis.TOKEN
        if self.k_token:
            self.NJK = self.D // self.GK  # S accumulators: one per channel block
            self.NTK = 1
        else:
            if page_size % self.GK:
                raise ValueError(f"page_size {page_size} must be a multiple of the channel-wise K group {self.GK}")
            self.NJK = 1
            self.NTK = max(1, STEP // self.GK)  # token groups per step (scaled Q' copies along N)
            self.KGP = page_size // self.GK  # groups per page
        self.NQK = self.NTK * self.NM  # QK MMA N
        if self.v_token:
            self.NJV = self.D // self.GV
            self.JPM = max(1, self.DM // self.GV)  # channel blocks per m-tile
            self.P_STAGES = self.NJV
        else:
            if page_size % self.GV:
                raise ValueError(f"page_size {page_size} must be a multiple of the channel-wise V group {self.GV}")
            self.NTV = max(1, STEP // self.GV)
            self.JPM = self.NTV  # token groups per step
            self.VGP = page_size // self.GV
            self.P_STAGES = 1
        self.S_COLS = self.NJK * self.NQK
        self.O_COLS = self.MT * self.JPM * self.NM
        # TMEM: S and O double-buffered where the 512 columns allow (S first: the softmax is the
        # longest role, so the next QK should not wait for it)
        for ss, os_ in ((2, 2), (2, 1), (1, 2), (1, 1)):
            if ss * self.S_COLS + os_ * self.O_COLS <= 512:
                break
        else:
            raise NotImplementedError(f"{scheme.name}: needs {self.S_COLS + self.O_COLS} TMEM columns")
        self.S_STAGES, self.O_STAGES = ss, os_
        self.tmem_cols = max(32, 1 << (ss * self.S_COLS + os_ * self.O_COLS - 1).bit_length())
        self.q_dtype = BFloat16 if scheme.q_dtype == torch.bfloat16 else Float16
        self.threads = 4 * WG
        # ---- ring of bulk-copied 64-token tiles (int32 words): K codes | V codes | K params | V params.
        # Channel-wise V params are consumed by the output warpgroup, which runs a step behind the
        # others: the softmax warpgroup copies the step's (scale, offset) rows from the ring into a
        # small smem area (sVp, one buffer per P buffer) handed over with alpha / Psum (st_ch), so
        # the ring stages are released as early as before.
        self.NGK = 1 if self.k_token else max(1, TILE_TOKENS // self.GK)  # channel-wise K groups per tile
        self.NGV = 1 if self.v_token else max(1, TILE_TOKENS // self.GV)  # channel-wise V groups per tile
        self.KPW = TILE_TOKENS * self.NJK if self.k_token else self.NGK * self.D  # one (s, z) fp16 pair per word
        self.VPW = TILE_TOKENS * self.NJV if self.v_token else self.NGV * self.D
        self.VP_WORDS = 0 if self.v_token else self.NTV * self.D  # sVp words per P buffer (channel-wise V)
        self.K_CODES, self.V_CODES, self.K_PARAMS = 0, self.TW, 2 * self.TW
        self.V_PARAMS = self.K_PARAMS + self.KPW
        self.STAGE_WORDS = self.V_PARAMS + self.VPW
        self.STAGE_BYTES = 4 * self.STAGE_WORDS
        # ---- stage counts from the shared-memory budget: operand stages (prep -> MMA), P stages
        # (softmax -> MMA, with the per-step softmax statistics for the output WG), ring tiles
        # (producer -> prep + softmax). Upgraded in order of benefit while they fit.
        self.OP_STAGES, self.P_BUFS, self.RING = 1, 1, 2
        if self.smem_bytes() > SMEM_BUDGET:
            raise NotImplementedError(f"{scheme.name}: {self.smem_bytes()} B of shared memory")
        # two operand stages double the prep warpgroup's hoisted store addresses: with 4 vectors per
        # thread per tile (INT4, head_dim 256) that spills, so those keep one operand stage
        op2 = () if self.NV // WG >= 4 else (("OP_STAGES", 2),)
        for attr, val in (*op2, ("RING", 4), ("P_BUFS", 2), ("RING", 6), ("RING", 8)):
            old = getattr(self, attr)
            setattr(self, attr, val)
            if self.smem_bytes() > SMEM_BUDGET:
                setattr(self, attr, old)

    def smem_bytes(self) -> int:
        """Shared memory of the kernel's SharedStorage (upper estimate, 1 KB alignment per buffer)."""
        def al(x):
            return (x + 1023) // 1024 * 1024

        q_stages = 1 if self.k_token else self.OP_STAGES
        operands = self.OP_STAGES * (al(STEP * self.D) + al(self.MT * STEP * STEP)) + q_stages * al(self.NQK * self.D)
        p = self.P_BUFS * (al(self.NM * STEP * self.P_STAGES) + 4 * (32 + 64))
        ring = al(self.RING * self.STAGE_BYTES)
        corr = self.NJV * self.N * WG * 4 if self.v_token else 0
        misc = (0 if self.k_token else self.N * self.D * 4) + 16 * self.D + 2 * 4 * 64 * (1 + self.P_STAGES) + 4096
        vp = self.P_BUFS * self.VP_WORDS * 4
        return operands + p + ring + corr + misc + vp + self.OP_STAGES * 4 * 80



def _v_block(cfg: BlackwellConfig, mt: int, jl: int) -> int:
    """Global V channel block (token-wise V) of local block ``jl`` of m-tile ``mt``."""
    return (mt * cfg.DM + jl * min(cfg.GV, cfg.DM)) // cfg.GV


def _pv_stage(cfg: BlackwellConfig, mt: int, jl: int) -> int:
    """P'^T stage read by PV accumulator (mt, jl)."""
    return _v_block(cfg, mt, jl) if cfg.v_token else 0


def _pv_kblocks(cfg: BlackwellConfig, jl: int):
    """(first, end) k-blocks of a step summed by PV accumulator (*, jl)."""
    if cfg.v_token:
        return 0, cfg.KB_S
    return jl * cfg.KB_S // cfg.NTV, (jl + 1) * cfg.KB_S // cfg.NTV



def _fabs(x):
    return cute.arch.fmax(x, -x)


def _exp_floor(x):
    """floor(log2 x) for x > 0 (x = 0 -> a huge negative clamp), as an exact FP32 integer."""
    return cute.math.floor(cute.math.log2(cute.arch.fmax(x, Float32(1e-30)), fastmath=True))


def _pow2_scale(x):
    """2^(FP8_TARGET_EXP - floor(log2 x)): puts x > 0 into [2^7, 2^8). exp2 of an integer is exact."""
    return cute.math.exp2(Float32(FP8_TARGET_EXP) - _exp_floor(x), fastmath=True)


def _max4(buf, o):
    return cute.arch.fmax(cute.arch.fmax(buf[o], buf[o + 1]), cute.arch.fmax(buf[o + 2], buf[o + 3]))


def _hilo(x):
    hi = x.to(Float8E4M3FN)
    return hi, (x - hi.to(Float32)).to(Float8E4M3FN)


def _swizzle(off, b: int, m: int, s: int):
    """CuTe Swizzle<b, m, s> of an offset: bits [m+s, m+s+b) XORed into [m, m+b)."""
    mask = ((1 << b) - 1) << (m + s)
    return off ^ ((off & mask) >> s)


def _scalar(ptr, idx):
    return cute.make_tensor(ptr + idx, cute.make_layout((1,)))


def _tile_head(pt_ptr, b, max_pages, kv_heads, h, n_tiles, tile, page_size: int):
    """(page * kv_heads + h, tile-in-page, first slot) of 64-token tile ``tile`` (clamped in range)."""
    tile = cutlass.min(tile, n_tiles - 1)
    tok0 = tile * TILE_TOKENS
    page = _scalar(pt_ptr, b.to(Int64) * max_pages + tok0 // page_size)[0]
    return page.to(Int64) * kv_heads + h, (tok0 % page_size) // TILE_TOKENS, tok0 % page_size


def _geometry(len_ptr, b, split, num_splits):
    """(length, n_tiles, t_begin, t_end, n_steps) of the CTA's token range: whole 128-token steps
    per split. Called inside each role (after the dispatch), so nothing is live across it."""
    length = _scalar(len_ptr, b)[0]
    n_tiles = (length + TILE_TOKENS - 1) // TILE_TOKENS
    per_split = (n_tiles + num_splits - 1) // num_splits
    per_split = per_split + per_split % 2
    t_begin = split * per_split
    t_end = cutlass.min(t_begin + per_split, n_tiles)
    return length, n_tiles, t_begin, t_end, (t_end - t_begin + 1) // 2


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


def _load_acc(t2r, thr_t2r, acc, nm: int):
    """One TMEM accumulator row (lane = thread of the warpgroup), nm fp32 columns -> registers."""
    src = thr_t2r.partition_S(acc[(None, None), 0, 0])  # (T2R, 1, 1)
    dst = cute.make_rmem_tensor(thr_t2r.partition_D(acc[(None, None), 0, 0]).shape, Float32)
    cute.copy(t2r, src, dst)
    return cute.make_tensor(dst.iterator, cute.make_layout((nm,)))


class BlackwellDecodeKernel:
    """Fused paged INT2/INT4 decode attention for sm_100a (see the module docstring)."""

    def __init__(self, cfg: BlackwellConfig):
        self.cfg = cfg

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,  # q dtype [B, Hq, D]
        kc_ptr: cute.Pointer,  # int32 [P, H, SUB, TW]
        kp_ptr: cute.Pointer,  # fp16 [P, H, PS, D/G, 2] (token-wise) or [P, H, PS/G, D, 2]
        vc_ptr: cute.Pointer,
        vp_ptr: cute.Pointer,
        pt_ptr: cute.Pointer,  # int32 [B, max_pages]
        len_ptr: cute.Pointer,  # int32 [B]
        o_ptr: cute.Pointer,
        lse_ptr: cute.Pointer,
        batch: Int32,
        kv_heads: Int32,
        max_pages: Int32,
        num_splits: Int32,
        sm_scale: Float32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        ##############################################################################
        # Tiled MMAs: A (codes -> FP4/FP8) K-major from smem, B (FP8 hi/lo) K-major, acc F32 in TMEM.
        # The issuing MMAs carry the A format (E2M1 or E4M3) in their instruction descriptor;
        # desc_mma describes the A buffers byte-wise (the padded FP4 form has 1 byte per element).
        ##############################################################################
        def mma(a_dtype, n):
            return sm100_utils.make_trivial_tiled_mma(
                a_dtype, Float8E4M3FN, OperandMajorMode.K, OperandMajorMode.K, Float32, tcgen05.CtaGroup.ONE, (STEP, n)
            )

        mma_qk = mma(cfg.op_dtype, cfg.NQK)
        mma_pv = mma(cfg.op_dtype, cfg.NM)
        desc_mma = mma(OPERAND_SMEM_DTYPE, cfg.NM)
        q_stages = 1 if cfg.k_token else cfg.OP_STAGES
        # (MMA, MMA_M, MMA_K, STAGE): K step [128 tokens x D] bytes, one stage per operand stage
        sK_layout = sm100_utils.make_smem_layout_a(desc_mma, (STEP, cfg.NM, cfg.D), OPERAND_SMEM_DTYPE, cfg.OP_STAGES)
        # V^T step [128 channels x 128 tokens] bytes: stage = operand stage * MT + m-tile
        sV_layout = sm100_utils.make_smem_layout_a(desc_mma, (STEP, cfg.NM, STEP), OPERAND_SMEM_DTYPE, cfg.OP_STAGES * cfg.MT)
        # Q'^T [NQK x D] (channel-wise K: one per operand stage) and P'^T [NM x 128 tokens]
        # (stage = P buffer * P_STAGES + token-wise V channel block)
        sQ_layout = sm100_utils.make_smem_layout_b(mma_qk, (STEP, cfg.NQK, cfg.D), Float8E4M3FN, q_stages)
        sP_layout = sm100_utils.make_smem_layout_b(mma_pv, (STEP, cfg.NM, STEP), Float8E4M3FN, cfg.P_BUFS * cfg.P_STAGES)
        n_corr = cfg.NJV * cfg.N * WG if cfg.v_token else 1
        n_qf = cfg.N * cfg.D if not cfg.k_token else 1
        n_mbar = 2 * (cfg.RING + cfg.OP_STAGES + cfg.S_STAGES + 2 * cfg.P_BUFS + cfg.O_STAGES)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, n_mbar]
            tmem_addr: cute.struct.MemRange[Int32, 1]
            ring: cute.struct.Align[cute.struct.MemRange[Int32, cfg.RING * cfg.STAGE_WORDS], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[OPERAND_SMEM_DTYPE, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[OPERAND_SMEM_DTYPE, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sQ_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sP_layout)], 1024]
            # per query row: S unscale (scale_log2 / Q scale), Q scale, Qsum[j] (token-wise K)
            sQinfo: cute.struct.Align[cute.struct.MemRange[Float32, 16 * (2 + cfg.NJK)], 16]
            # channel-wise K, per operand stage: S unscale per token group, then C[t, r] * scale_log2
            sKinfo: cute.struct.Align[cute.struct.MemRange[Float32, KINFO * cfg.OP_STAGES], 16]
            sQf: cute.struct.Align[cute.struct.MemRange[Float32, n_qf], 16]  # q [N, D] fp32 (channel-wise K)
            sZ: cute.struct.Align[cute.struct.MemRange[Float32, 4 * cfg.D], 16]  # z[d, t] of the step
            # per P buffer: alpha per row, P unscale per channel block (32), Psum per warp and row (64)
            sAlpha: cute.struct.Align[cute.struct.MemRange[Float32, 32 * cfg.P_BUFS], 16]
            sPsum: cute.struct.Align[cute.struct.MemRange[Float32, 64 * cfg.P_BUFS], 16]
            sRed: cute.struct.Align[cute.struct.MemRange[Float32, 2 * 4 * 16 * (1 + cfg.P_STAGES)], 16]  # softmax, x2 by step parity
            sRedP: cute.struct.Align[cute.struct.MemRange[Float32, 4 * 16], 16]  # prep
            sCorr: cute.struct.Align[cute.struct.MemRange[Float32, n_corr], 16]  # token-wise V offset terms
            sFinal: cute.struct.Align[cute.struct.MemRange[Float32, 32 + 16 * cfg.P_STAGES], 16]
            # channel-wise V: the step's (scale, offset) fp16 pairs [group t, channel d], per P buffer
            sVp: cute.struct.Align[cute.struct.MemRange[Int32, max(1, cfg.P_BUFS * cfg.VP_WORDS)], 16]

        scale_log2 = sm_scale * LOG2E
        self.kernel(
            mma_qk, mma_pv, desc_mma, sK_layout, sV_layout, sQ_layout, sP_layout, SharedStorage,
            q_ptr, kc_ptr, kp_ptr, vc_ptr, vp_ptr, pt_ptr, len_ptr, o_ptr, lse_ptr,
            kv_heads, max_pages, num_splits, scale_log2,
        ).launch(
            grid=(num_splits, kv_heads, batch),
            block=(cfg.threads, 1, 1),
            smem=SharedStorage.size_in_bytes(),
            min_blocks_per_mp=1,  # .minnctapersm: lets ptxas honour the per-role setmaxnreg
            stream=stream,
        )

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        desc_mma: cute.TiledMma,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sQ_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
        q_ptr: cute.Pointer,
        kc_ptr: cute.Pointer,
        kp_ptr: cute.Pointer,
        vc_ptr: cute.Pointer,
        vp_ptr: cute.Pointer,
        pt_ptr: cute.Pointer,
        len_ptr: cute.Pointer,
        o_ptr: cute.Pointer,
        lse_ptr: cute.Pointer,
        kv_heads: Int32,
        max_pages: Int32,
        num_splits: Int32,
        scale_log2: Float32,
    ):
        cfg = self.cfg
        N, NM, D = cfg.N, cfg.NM, cfg.D
        tidx, _, _ = cute.arch.thread_idx()
        split, h, b = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        role = warp // 4
        t = tidx % WG  # thread within its warpgroup
        lane = tidx % 32
        wq = (tidx // 32) % 4  # warp within its warpgroup

        # ---------------------------------------------------------------- shared memory
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (MMA, MMA_M, MMA_K, OP_STAGES)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)  # (MMA, MMA_M, MMA_K, OP_STAGES*MT)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (MMA, MMA_N, MMA_K, 1 | OP_STAGES)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)  # (MMA, MMA_N, MMA_K, P_BUFS*P_STAGES)
        sQinfo = storage.sQinfo.get_tensor(cute.make_layout(16 * (2 + cfg.NJK)))
        sKinfo = storage.sKinfo.get_tensor(cute.make_layout(KINFO * cfg.OP_STAGES))
        sZ = storage.sZ.get_tensor(cute.make_layout(4 * D))
        sAlpha = storage.sAlpha.get_tensor(cute.make_layout(32 * cfg.P_BUFS))
        sPsum = storage.sPsum.get_tensor(cute.make_layout(64 * cfg.P_BUFS))
        sRed = storage.sRed.get_tensor(cute.make_layout(2 * 4 * 16 * (1 + cfg.P_STAGES)))
        sRedP = storage.sRedP.get_tensor(cute.make_layout(4 * 16))
        sCorr = storage.sCorr.get_tensor(cute.make_layout(cfg.NJV * N * WG if cfg.v_token else 1))
        sFinal = storage.sFinal.get_tensor(cute.make_layout(32 + 16 * cfg.P_STAGES))
        sQf = storage.sQf.get_tensor(cute.make_layout(N * D if not cfg.k_token else 1))
        sVp = storage.sVp.get_tensor(cute.make_layout(max(1, cfg.P_BUFS * cfg.VP_WORDS)))

        # ---------------------------------------------------------------- mbarrier channels
        # (full, empty) mbarrier pairs per stage (foscar.blackwell.pipeline), with arrival counts
        ring = storage.mbar.data_ptr()  # producer (expect_tx) -> prep + softmax: (1, 256)
        opnd = ring + 2 * cfg.RING  # prep -> MMA (commit after the step's PV): (128, 1)
        s_ch = opnd + 2 * cfg.OP_STAGES  # MMA (commit) -> softmax, S in TMEM: (1, 128)
        p_ch = s_ch + 2 * cfg.S_STAGES  # softmax -> MMA, P'^T in smem: (128, 1)
        st_ch = p_ch + 2 * cfg.P_BUFS  # softmax -> output: alpha, P unscale, Psum: (128, 128)
        o_ch = st_ch + 2 * cfg.P_BUFS  # MMA (commit) -> output, O partials in TMEM: (1, 128)

        # ---------------------------------------------------------------- barriers + TMEM
        if tidx == 0:
            pl.init(ring, cfg.RING, 1, 2 * WG)
            pl.init(opnd, cfg.OP_STAGES, WG, 1)
            pl.init(s_ch, cfg.S_STAGES, 1, WG)
            pl.init(p_ch, cfg.P_BUFS, WG, 1)
            pl.init(st_ch, cfg.P_BUFS, WG, WG)
            pl.init(o_ch, cfg.O_STAGES, 1, WG)
            cute.arch.mbarrier_init_fence()
        tmem_holder = storage.tmem_addr.data_ptr()
        if warp == 0:
            cute.arch.alloc_tmem(cfg.tmem_cols, tmem_holder)
        cute.arch.sync_threads()

        # ---------------------------------------------------------------- MMA partitions
        s_layout = mma_qk.make_fragment_C(mma_qk.get_slice(0).partition_shape_C((STEP, cfg.NQK))).layout
        acc_layout = mma_pv.make_fragment_C(mma_pv.get_slice(0).partition_shape_C((STEP, NM))).layout  # ((128, NM), 1, 1)
        nd = max(1, D // WG)  # channels per thread (head_dim 64: threads t and t+64 share one)
        ring_words = storage.ring.data_ptr()

        # ================================================================ roles
        # Nothing dynamic is computed before the dispatch: the TMEM address and the CTA's token range
        # (``_geometry``) are (re)computed inside each role, so no value stays live across it (ptxas
        # spilled such values when one role ran at its setmaxnreg ceiling).
        if role == WG_PREP:
            cute.arch.setmaxregister_increase(REGS[WG_PREP])
            self.prep(
                sQ, sQinfo, sKinfo, sQf, sZ, sRedP, storage, sK_layout, sV_layout, ring, opnd, ring_words,
                q_ptr, len_ptr, b, h, split, kv_heads, num_splits, scale_log2, t, lane, wq, nd,
            )

        if role == WG_MMA:
            cute.arch.setmaxregister_decrease(REGS[WG_MMA])
            if warp == 1:
                self.produce(ring, ring_words, kc_ptr, kp_ptr, vc_ptr, vp_ptr, pt_ptr, len_ptr, b, h, split, kv_heads,
                             max_pages, num_splits, lane)
            if warp == 0:
                self.issue_mma(mma_qk, mma_pv, desc_mma, sK, sV, sQ, sP, tmem_holder, s_layout, acc_layout,
                               opnd, s_ch, p_ch, o_ch, len_ptr, b, split, num_splits)

        if role == WG_SOFTMAX:
            cute.arch.setmaxregister_increase(REGS[WG_SOFTMAX])
            self.softmax(
                sP, sQinfo, sKinfo, sAlpha, sPsum, sRed, sCorr, sFinal, sVp, ring, opnd, s_ch, p_ch, st_ch,
                ring_words, len_ptr, b, split, num_splits, t, lane, wq, tmem_holder, acc_layout, nd,
            )

        if role == WG_OUTPUT:
            cute.arch.setmaxregister_increase(REGS[WG_OUTPUT])
            self.output(
                sAlpha, sPsum, sFinal, sVp, st_ch, o_ch, tmem_holder, acc_layout, o_ptr, lse_ptr, len_ptr,
                b, h, split, kv_heads, num_splits, t, wq, nd,
            )

        cute.arch.sync_threads()
        if warp == 0:
            cute.arch.dealloc_tmem(cute.arch.retrieve_tmem_ptr(Float32, 16, tmem_holder), cfg.tmem_cols)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def produce(self, ring, ring_words, kc_ptr, kp_ptr, vc_ptr, vp_ptr, pt_ptr, len_ptr, b, h, split, kv_heads,
                max_pages, num_splits, lane):
        """Producer warp (warp 1): one lane issues the 1-D bulk copies of each 64-token tile (K codes,
        V codes, K params, V params: each contiguous in global memory) into the ring.
        Local tile i = 2*step + half uses ring stage i % RING; a tile past the CTA's range repeats
        the last tile of the sequence (finite codes, masked by the softmax)."""
        cfg = self.cfg
        if lane == 0:
            _length, n_tiles, t_begin, _t_end, n_steps = _geometry(len_ptr, b, split, num_splits)
            for i in cutlass.range(0, 2 * n_steps, 1, unroll=1):
                head, sub, slot0 = _tile_head(pt_ptr, b, max_pages, kv_heads, h, n_tiles, t_begin + i, cfg.page_size)
                st = pl.stage(i, cfg.RING)
                pl.wait_empty(ring, cfg.RING, i)
                cute.arch.mbarrier_arrive_and_expect_tx(pl.full(ring, cfg.RING, st), cfg.STAGE_BYTES)
                dst = ring_words + cute.assume(st * cfg.STAGE_WORDS, divby=4)
                codes = cute.assume((head * cfg.SUB + sub) * cfg.TW, divby=4)
                bulk_copy_g2s(dst + cfg.K_CODES, kc_ptr + codes, 4 * cfg.TW, pl.full(ring, cfg.RING, st))
                bulk_copy_g2s(dst + cfg.V_CODES, vc_ptr + codes, 4 * cfg.TW, pl.full(ring, cfg.RING, st))
                bulk_copy_g2s(dst + cfg.K_PARAMS, kp_ptr + 2 * self.params_row(head, slot0, "k"), 4 * cfg.KPW, pl.full(ring, cfg.RING, st))
                bulk_copy_g2s(dst + cfg.V_PARAMS, vp_ptr + 2 * self.params_row(head, slot0, "v"), 4 * cfg.VPW, pl.full(ring, cfg.RING, st))

    def params_row(self, head, slot0, which):
        """Index of a tile's first (scale, offset) pair (token rows, or channel-wise groups x D)."""
        cfg = self.cfg
        if (cfg.k_token if which == "k" else cfg.v_token):
            return cute.assume((head * cfg.page_size + slot0) * (cfg.NJK if which == "k" else cfg.NJV), divby=4)
        if which == "k":
            return cute.assume((head * cfg.KGP + slot0 // cfg.GK) * cfg.D, divby=4)
        return cute.assume((head * cfg.VGP + slot0 // cfg.GV) * cfg.D, divby=4)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def issue_mma(self, mma_qk, mma_pv, desc_mma, sK, sV, sQ, sP, tmem_holder, s_layout, acc_layout,
                  opnd, s_ch, p_ch, o_ch, len_ptr, b, split, num_splits):
        """MMA warp (warp 0). Iteration i issues QK of step i, then PV of step i-1, so the next
        step's S is in TMEM while the softmax warpgroup works on the previous one. The smem
        descriptors are built here (after the role dispatch) and indexed by the dynamic stage, so
        ptxas derives them from a base per step instead of keeping every MMA's descriptor live."""
        cfg = self.cfg
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, 16, tmem_holder)
        n_steps = _geometry(len_ptr, b, split, num_splits)[4]
        tCrK = desc_mma.make_fragment_A(sK)  # descriptors (MMA, 1, KB_D, OP_STAGES)
        tCrV = desc_mma.make_fragment_A(sV)  # (MMA, 1, KB_S, OP_STAGES*MT)
        tCrQ = mma_qk.make_fragment_B(sQ)  # (MMA, 1, KB_D, 1 | OP_STAGES)
        tCrP = mma_pv.make_fragment_B(sP)  # (MMA, 1, KB_S, P_BUFS*P_STAGES)
        # PV(i - lag) after QK(i): lag 1 overlaps the next QK with the softmax; with one operand stage
        # QK(i) needs the stage that PV(i - 1) frees, so lag 0 there (no deadlock).
        lag = 1 if cfg.OP_STAGES > 1 else 0
        for i in cutlass.range(0, n_steps + lag, 1, unroll=1):
            if i < n_steps:
                so = pl.stage(i, cfg.OP_STAGES)
                ss = pl.stage(i, cfg.S_STAGES)
                pl.wait_full(opnd, cfg.OP_STAGES, i)  # A (K) and Q'^T in smem
                pl.wait_empty(s_ch, cfg.S_STAGES, i)  # softmax has read S stage ss
                tcgen05_fence_after()
                for j in cutlass.range_constexpr(cfg.NJK):
                    # S^T_j = K[:, block j] . Q'^T[block j, :]  (token-wise K: one accumulator per block j)
                    tS = cute.make_tensor(tmem_ptr + ss * cfg.S_COLS + j * cfg.NQK, s_layout)
                    mma_qk.set(tcgen05.Field.ACCUMULATE, False)
                    for kb in cutlass.range_constexpr(j * cfg.KB_D // cfg.NJK, (j + 1) * cfg.KB_D // cfg.NJK):
                        qs = 0 if cfg.k_token else so
                        cute.gemm(mma_qk, tS, tCrK[None, None, kb, so], tCrQ[None, None, kb, qs], tS)
                        mma_qk.set(tcgen05.Field.ACCUMULATE, True)
                with cute.arch.elect_one():
                    tcgen05.commit(pl.full(s_ch, cfg.S_STAGES, ss))
            if i >= lag:
                k = i - lag
                so = pl.stage(k, cfg.OP_STAGES)
                sp = pl.stage(k, cfg.P_BUFS)
                sO = pl.stage(k, cfg.O_STAGES)
                pl.wait_full(p_ch, cfg.P_BUFS, k)  # P'^T in smem
                pl.wait_empty(o_ch, cfg.O_STAGES, k)  # output warpgroup has read O stage sO
                tcgen05_fence_after()
                for mt in cutlass.range_constexpr(cfg.MT):
                    for jl in cutlass.range_constexpr(cfg.JPM):
                        # token-wise V: O^T_{mt,j} = V^T[m-tile mt] . (P'^T scaled for channel block j)
                        # channel-wise V: O^T_{mt,t} = V^T[m-tile mt, group t] . P'^T[group t]
                        tO = cute.make_tensor(tmem_ptr + cfg.S_STAGES * cfg.S_COLS + sO * cfg.O_COLS
                                              + (mt * cfg.JPM + jl) * cfg.NM, acc_layout)
                        mma_pv.set(tcgen05.Field.ACCUMULATE, False)
                        for kb in cutlass.range_constexpr(*_pv_kblocks(cfg, jl)):
                            cute.gemm(mma_pv, tO, tCrV[None, None, kb, so * cfg.MT + mt],
                                      tCrP[None, None, kb, sp * cfg.P_STAGES + _pv_stage(cfg, mt, jl)], tO)
                            mma_pv.set(tcgen05.Field.ACCUMULATE, True)
                with cute.arch.elect_one():
                    tcgen05.commit(pl.full(o_ch, cfg.O_STAGES, sO))
                    tcgen05.commit(pl.empty(p_ch, cfg.P_BUFS, sp))
                    tcgen05.commit(pl.empty(opnd, cfg.OP_STAGES, so))

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def prep(
        self, sQ, sQinfo, sKinfo, sQf, sZ, sRed, storage, sK_layout, sV_layout, ring, opnd,
        ring_words, q_ptr, len_ptr, b, h, split, kv_heads, num_splits, scale_log2, t, lane, wq, nd: cutlass.Constexpr,
    ):
        """Preparation warpgroup: Q'^T hi/lo, Qsum / C corrections, A operands from packed words."""
        cfg = self.cfg
        N, D, R = cfg.N, cfg.D, cfg.R
        q_base = (b * kv_heads * R + h * R).to(Int64) * D
        # ---- q per row, its power-of-two scale; thread t owns channels d = (t + 128*i) % D
        for r in cutlass.range_constexpr(N):
            rr = min(r, R - 1)
            qv = cute.make_rmem_tensor((nd,), Float32)
            amax = Float32(0.0)
            for i in cutlass.range_constexpr(nd):
                d = (t + WG * i) % D
                x = _scalar(q_ptr, q_base + rr * D + d)[0].to(Float32)
                qv[i] = x if r < R else Float32(0.0)
                amax = cute.arch.fmax(amax, _fabs(qv[i]))
            amax = cute.arch.warp_reduction(amax, cute.arch.fmax)
            if lane == 0:
                sRed[4 * r + wq] = amax
            cute.arch.barrier(barrier_id=BAR_PREP, number_of_threads=WG)
            sc = _pow2_scale(_max4(sRed, 4 * r))
            for i in cutlass.range_constexpr(nd):
                d = (t + WG * i) % D
                if cutlass.const_expr(cfg.k_token):  # Q^T hi/lo once
                    qhi, qlo = _hilo(qv[i] * sc)
                    sQ[((r, d % 32), 0, d // 32, 0)] = qhi
                    sQ[((N + r, d % 32), 0, d // 32, 0)] = qlo
                else:  # kept for the per-step Q' and C
                    sQf[r * D + d] = qv[i]
            if t == 0:
                sQinfo[r] = scale_log2 / sc  # S unscale, log2(e)*sm_scale folded in
                sQinfo[16 + r] = sc
        if cutlass.const_expr(cfg.k_token):
            # Qsum[r][j] of the unrounded q (offset correction of token-wise K), one (r, j) per thread
            if t < N * cfg.NJK:
                r, j = t // cfg.NJK, t % cfg.NJK
                acc = Float32(0.0)
                for c in cutlass.range(j * cfg.GK, (j + 1) * cfg.GK, 1, unroll=8):
                    acc = acc + _scalar(q_ptr, q_base + cutlass.min(r, R - 1) * D + c)[0].to(Float32)
                sQinfo[32 + t] = fsel(r < R, acc * scale_log2, Float32(0.0))
        cute.arch.barrier(barrier_id=BAR_PREP, number_of_threads=WG)

        E = cfg.E
        vec_per_thread = max(1, cfg.NV // WG)  # 16-byte vectors per thread per tile
        vt = t % cfg.NV  # head_dim 64 INT2: threads t and t+64 duplicate one vector
        ku32 = cute.recast_ptr(storage.sK.data_ptr(), dtype=Int32)
        vu32 = cute.recast_ptr(storage.sV.data_ptr(), dtype=Int32)
        ksw, vsw = sK_layout.inner, sV_layout.inner
        n_steps = _geometry(len_ptr, b, split, num_splits)[4]
        for step in cutlass.range(0, n_steps, 1, unroll=1):
            so = pl.stage(step, cfg.OP_STAGES)
            pl.wait_full(ring, cfg.RING, 2 * step)  # both tiles of the step in the ring
            pl.wait_full(ring, cfg.RING, 2 * step + 1)
            pl.wait_empty(opnd, cfg.OP_STAGES, step)  # the MMAs of step - OP_STAGES have read operand stage so
            if cutlass.const_expr(not cfg.k_token):
                self.prep_q_channelwise(sQ, sKinfo, sQf, sZ, sRed, sQinfo, ring, ring_words, step, so, scale_log2,
                                        t, lane, wq, nd)
            # ---- K and V^T operands from the packed words of the ring (16-byte shared loads)
            k_stage_words = cute.assume(so * (cute.crd2idx(((0, 0), 0, 0, 1), sK_layout.outer) // 4), divby=256)
            v_stage_words = cute.assume(so * (cfg.MT * cute.crd2idx(((0, 0), 0, 0, 1), sV_layout.outer) // 4), divby=256)
            for half in cutlass.range_constexpr(2):
                tile_words = ring_words + cute.assume(pl.stage(2 * step + half, cfg.RING) * cfg.STAGE_WORDS, divby=4)
                for is_v in cutlass.range_constexpr(2):
                    # (4 words, thread, vector): vector j of thread t = tile vector j*128 + t
                    src = cute.make_tensor(tile_words + (cfg.V_CODES if is_v else cfg.K_CODES),
                                           cute.make_layout((4, WG, vec_per_thread), stride=(1, 4, 4 * WG)))
                    words = cute.make_rmem_tensor((4, vec_per_thread), Int32)
                    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128)
                    cute.copy(atom, src[None, vt, None], words)
                    cpr = (TILE_TOKENS if is_v else D) // E  # chunks per row
                    for v in cutlass.range_constexpr(vec_per_thread):
                        for wi in cutlass.range_constexpr(4):
                            w = Uint32(words[wi, v])
                            # the recipe (foscar.blackwell.operands): lo = w & MASK, hi = (w >> bits) & MASK
                            lo = Int32(cute.arch.lop3(w, Uint32(cfg.mask), Uint32(0), 0xC0))
                            hi = Int32(cute.arch.lop3(w >> cfg.bits, Uint32(cfg.mask), Uint32(0), 0xC0))
                            n = (v * WG + vt) * 4 + wi  # word of the tile: (row, chunk) row-major
                            row = n // cpr
                            col = (n % cpr) * E
                            if cutlass.const_expr(is_v):  # V^T: row = channel, K mode = token
                                _store_chunk(vu32, sV_layout.outer, vsw, row % cfg.DM, col + TILE_TOKENS * half,
                                             row // cfg.DM, lo, hi, v_stage_words)
                            else:  # K: row = token, K mode = channel
                                _store_chunk(ku32, sK_layout.outer, ksw, row + TILE_TOKENS * half, col, 0, lo, hi,
                                             k_stage_words)
            pl.release(ring, cfg.RING, 2 * step)
            pl.release(ring, cfg.RING, 2 * step + 1)
            cute.arch.fence_view_async_shared()  # generic smem writes -> visible to tcgen05 (async proxy)
            pl.publish(opnd, cfg.OP_STAGES, step)

    @cute.jit
    def prep_q_channelwise(self, sQ, sKinfo, sQf, sZ, sRed, sQinfo, ring, ring_words, step, so,
                           scale_log2, t, lane, wq, nd: cutlass.Constexpr):
        """Channel-wise K, one step: Q'[t] = Q * s[:, t] * 2^-e_t (hi/lo, N columns per token group
        t side by side, operand stage so) and C[t, r] = sum_d z[d, t] q[r, d]; params from the ring."""
        cfg = self.cfg
        N, NM, D = cfg.N, cfg.NM, cfg.D
        kinfo = so * KINFO
        cute.arch.barrier(barrier_id=BAR_PREP, number_of_threads=WG)  # previous step's sZ / sRed reads done
        ks = cute.make_rmem_tensor((cfg.NTK * nd,), Float32)
        for tk in cutlass.range_constexpr(cfg.NTK):
            off = tk * min(cfg.GK, STEP)  # first token of group tk in the step
            grp = (off % TILE_TOKENS) // cfg.GK if cfg.GK < TILE_TOKENS else 0  # group within its tile
            tile_words = ring_words + cute.assume(pl.stage(2 * step + off // TILE_TOKENS, cfg.RING) * cfg.STAGE_WORDS, divby=4)
            kp_ring = cute.recast_ptr(tile_words + cfg.K_PARAMS + grp * D, dtype=Float16)
            smax = Float32(0.0)
            for i in cutlass.range_constexpr(nd):
                d = (t + WG * i) % D
                kp = cute.make_tensor(kp_ring + 2 * d, cute.make_layout((2,)))
                ks[tk * nd + i] = kp[0].to(Float32)
                sZ[tk * D + d] = kp[1].to(Float32)
                smax = cute.arch.fmax(smax, _fabs(ks[tk * nd + i]))
            smax = cute.arch.warp_reduction(smax, cute.arch.fmax)
            if lane == 0:
                sRed[4 * tk + wq] = smax
        cute.arch.barrier(barrier_id=BAR_PREP, number_of_threads=WG)
        for tk in cutlass.range_constexpr(cfg.NTK):
            e = _exp_floor(_max4(sRed, 4 * tk)) + Float32(1.0)  # max_d |s| < 2^e
            s_norm = cute.math.exp2(-e, fastmath=True)
            if t == 0:
                sKinfo[kinfo + tk] = cute.math.exp2(e, fastmath=True) * cfg.a_inv
            for r in cutlass.range_constexpr(N):
                qs = sQinfo[16 + r] * s_norm
                for i in cutlass.range_constexpr(nd):
                    d = (t + WG * i) % D
                    qhi, qlo = _hilo(sQf[r * D + d] * qs * ks[tk * nd + i])  # |.| < 256
                    sQ[((tk * NM + r, d % 32), 0, d // 32, so)] = qhi
                    sQ[((tk * NM + N + r, d % 32), 0, d // 32, so)] = qlo
        cute.arch.barrier(barrier_id=BAR_PREP, number_of_threads=WG)
        # C[tk, r]: two threads per (tk, r), half of the channels each
        x = t // 2
        if x < cfg.NTK * N:
            tk, r = x // N, x % N
            half = t % 2
            acc = Float32(0.0)
            for d in cutlass.range(half * (D // 2), (half + 1) * (D // 2), 1, unroll=8):
                acc = acc + sZ[tk * D + d] * sQf[r * D + d]
            acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=1)
            if half == 0:
                sKinfo[kinfo + 4 + tk * 16 + r] = acc * scale_log2

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def softmax(
        self, sP, sQinfo, sKinfo, sAlpha, sPsum, sRed, sCorr, sFinal, sVp, ring, opnd,
        s_ch, p_ch, st_ch, ring_words, len_ptr, b, split, num_splits,
        t, lane, wq, tmem_holder, acc_layout, nd: cutlass.Constexpr,
    ):
        """Softmax warpgroup (thread = token of the step): S, online softmax, P'^T, V offset terms;
        channel-wise V: the step's (scale, offset) rows ring -> sVp for the output warpgroup."""
        cfg = self.cfg
        N, NM, D = cfg.N, cfg.NM, cfg.D
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, 16, tmem_holder)
        t2r, thr_t2r = _t2r(tmem_ptr, acc_layout, t, NM)
        length, _n_tiles, t_begin, t_end, n_steps = _geometry(len_ptr, b, split, num_splits)
        RED = 4 * 16 * (1 + cfg.P_STAGES)  # sRed half (by step parity: one barrier per step suffices)
        m_run = cute.make_rmem_tensor((N,), Float32)
        l_run = cute.make_rmem_tensor((N,), Float32)  # per-thread partial (one token per step)
        for r in cutlass.range_constexpr(N):
            m_run[r] = Float32(NEG_INF)
            l_run[r] = Float32(0.0)
        if cutlass.const_expr(cfg.v_token):
            for x in cutlass.range_constexpr(cfg.NJV * N):
                sCorr[x * WG + t] = Float32(0.0)  # per-thread sum_l z[l,j] p[l] (column x = j*N + r)
        u = t // TILE_TOKENS  # tile of the step holding this thread's token
        for step in cutlass.range(0, n_steps, 1, unroll=1):
            ss = pl.stage(step, cfg.S_STAGES)
            sp = pl.stage(step, cfg.P_BUFS)
            red = (step % 2) * RED
            tile = t_begin + 2 * step + u
            tok = tile * TILE_TOKENS + t % TILE_TOKENS
            ok = (tok < length) & (tile < t_end)
            pl.wait_full(ring, cfg.RING, 2 * step)  # this step's params (token-wise K and V) are in the ring
            pl.wait_full(ring, cfg.RING, 2 * step + 1)
            prm = cute.recast_ptr(ring_words + cute.assume(pl.stage(2 * step + u, cfg.RING) * cfg.STAGE_WORDS, divby=4), dtype=Float16)
            if cutlass.const_expr(not cfg.k_token):
                pl.wait_full(opnd, cfg.OP_STAGES, step)  # sKinfo of operand stage so (prep)
            pl.wait_full(s_ch, cfg.S_STAGES, step)  # S of this step in TMEM (tcgen05.commit)
            tcgen05_fence_after()
            sc = cute.make_rmem_tensor((N,), Float32)
            if cutlass.const_expr(cfg.k_token):
                for r in cutlass.range_constexpr(N):
                    sc[r] = Float32(0.0)
                for j in cutlass.range_constexpr(cfg.NJK):
                    kp = cute.make_tensor(prm + 2 * (cfg.K_PARAMS + (t % TILE_TOKENS) * cfg.NJK + j), cute.make_layout((2,)))
                    ks = kp[0].to(Float32) * cfg.a_inv
                    kz = kp[1].to(Float32)
                    acc = _load_acc(t2r, thr_t2r, cute.make_tensor(tmem_ptr + ss * cfg.S_COLS + j * cfg.NQK, acc_layout), NM)
                    cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before the registers are used
                    for r in cutlass.range_constexpr(N):
                        sc[r] = sc[r] + ks * (acc[r] + acc[N + r]) * sQinfo[r] + kz * sQinfo[32 + r * cfg.NJK + j]
            else:
                so = pl.stage(step, cfg.OP_STAGES)
                tk = (wq * 32) // cfg.GK if cfg.GK < STEP else 0  # token group of this warp
                acc = _load_acc(t2r, thr_t2r, cute.make_tensor(tmem_ptr + ss * cfg.S_COLS + tk * NM, acc_layout), NM)
                cute.arch.fence_view_async_tmem_load()
                unscale = sKinfo[so * KINFO + tk]
                for r in cutlass.range_constexpr(N):
                    sc[r] = (acc[r] + acc[N + r]) * unscale * sQinfo[r] + sKinfo[so * KINFO + 4 + tk * 16 + r]
            tcgen05_fence_before()
            pl.release(s_ch, cfg.S_STAGES, step)  # S stage free for the QK of step + S_STAGES
            # column max over the 128 tokens of the step
            for r in cutlass.range_constexpr(N):
                sc[r] = fsel(ok, sc[r], Float32(NEG_INF))
                mx = cute.arch.warp_reduction(sc[r], cute.arch.fmax)
                if lane == 0:
                    sRed[red + 4 * r + wq] = mx
            if cutlass.const_expr(cfg.v_token):
                # max over tokens of the V scales per channel block (power-of-two normalisation of P*s)
                vs = cute.make_rmem_tensor((cfg.NJV,), Float32)
                vz = cute.make_rmem_tensor((cfg.NJV,), Float32)
                for j in cutlass.range_constexpr(cfg.NJV):
                    vp = cute.make_tensor(prm + 2 * (cfg.V_PARAMS + (t % TILE_TOKENS) * cfg.NJV + j), cute.make_layout((2,)))
                    vs[j] = fsel(ok, vp[0].to(Float32), Float32(0.0))
                    vz[j] = fsel(ok, vp[1].to(Float32), Float32(0.0))
                    mv = cute.arch.warp_reduction(_fabs(vs[j]), cute.arch.fmax)
                    if lane == 0:
                        sRed[red + 4 * 16 * (1 + j) + wq] = mv
            else:
                # channel-wise V: (scale, offset) words of group tv, channel d = (t + 128*i) % D, into
                # registers now (the ring stages are released below), into sVp once buffer sp is free
                vpw = cute.make_rmem_tensor((cfg.NTV * nd,), Int32)
                for tv in cutlass.range_constexpr(cfg.NTV):
                    off = tv * min(cfg.GV, STEP)  # first token of group tv in the step
                    grp = (off % TILE_TOKENS) // cfg.GV if cfg.GV < TILE_TOKENS else 0  # group within its tile
                    vp_ring = ring_words + cute.assume(pl.stage(2 * step + off // TILE_TOKENS, cfg.RING) * cfg.STAGE_WORDS, divby=4)
                    for i in cutlass.range_constexpr(nd):
                        vpw[tv * nd + i] = _scalar(vp_ring, cfg.V_PARAMS + grp * D + (t + WG * i) % D)[0]
            pl.release(ring, cfg.RING, 2 * step)  # last ring read of this step (params)
            pl.release(ring, cfg.RING, 2 * step + 1)
            cute.arch.barrier(barrier_id=BAR_SOFTMAX, number_of_threads=WG)
            pl.wait_empty(p_ch, cfg.P_BUFS, step)  # the PV of step - P_BUFS has read P buffer sp
            pl.wait_empty(st_ch, cfg.P_BUFS, step)  # the output warpgroup has read the statistics of buffer sp
            if cutlass.const_expr(not cfg.v_token):
                for tv in cutlass.range_constexpr(cfg.NTV):
                    for i in cutlass.range_constexpr(nd):
                        if t + WG * i < D:  # head_dim 64: threads t and t+64 hold the same word
                            sVp[sp * cfg.VP_WORDS + tv * D + t + WG * i] = vpw[tv * nd + i]
            pscale = cute.make_rmem_tensor((cfg.P_STAGES,), Float32)
            for j in cutlass.range_constexpr(cfg.P_STAGES):
                if cutlass.const_expr(cfg.v_token):
                    pscale[j] = _pow2_scale(_max4(sRed, red + 4 * 16 * (1 + j)))
                else:
                    pscale[j] = Float32(2.0**FP8_TARGET_EXP)  # P <= 1
                if t == 0:
                    sAlpha[sp * 32 + 16 + j] = cfg.a_inv / pscale[j]  # exact: powers of two
            for r in cutlass.range_constexpr(N):
                m_new = cute.arch.fmax(m_run[r], _max4(sRed, red + 4 * r))
                m_use = fsel(m_new == Float32(NEG_INF), Float32(0.0), m_new)
                alpha = cute.math.exp2(m_run[r] - m_use, fastmath=True)
                m_run[r] = m_new
                p = cute.math.exp2(sc[r] - m_use, fastmath=True)
                l_run[r] = l_run[r] * alpha + p
                if t == 0:
                    sAlpha[sp * 32 + r] = alpha
                for j in cutlass.range_constexpr(cfg.P_STAGES):
                    if cutlass.const_expr(cfg.v_token):
                        x = (j * N + r) * WG + t
                        sCorr[x] = sCorr[x] * alpha + p * vz[j]
                        phi, plo = _hilo(p * vs[j] * pscale[j])
                    else:
                        phi, plo = _hilo(p * pscale[j])
                    sP[((r, t % 32), 0, t // 32, sp * cfg.P_STAGES + j)] = phi
                    sP[((N + r, t % 32), 0, t // 32, sp * cfg.P_STAGES + j)] = plo
                if cutlass.const_expr(not cfg.v_token):  # Psum per warp (a token group is whole warps)
                    ps = cute.arch.warp_reduction(p, lambda a, c: a + c)
                    if lane == 0:
                        sPsum[sp * 64 + wq * 16 + r] = ps
            cute.arch.fence_view_async_shared()  # P'^T (generic stores) -> visible to tcgen05.mma
            pl.publish(p_ch, cfg.P_BUFS, step)
            pl.publish(st_ch, cfg.P_BUFS, step)
        cute.arch.barrier(barrier_id=BAR_SOFTMAX, number_of_threads=WG)  # last step's sRed reads done
        # ---- final: l and the token-wise V offset terms, reduced over the 128 threads
        for r in cutlass.range_constexpr(N):
            ls = cute.arch.warp_reduction(l_run[r], lambda a, c: a + c)
            if lane == 0:
                sRed[4 * r + wq] = ls
            if cutlass.const_expr(cfg.v_token):
                for j in cutlass.range_constexpr(cfg.NJV):
                    cs = cute.arch.warp_reduction(sCorr[(j * N + r) * WG + t], lambda a, c: a + c)
                    if lane == 0:
                        sRed[4 * 16 * (1 + j) + 4 * r + wq] = cs
        cute.arch.barrier(barrier_id=BAR_SOFTMAX, number_of_threads=WG)
        if t < N:
            r = t
            sFinal[r] = sRed[4 * r] + sRed[4 * r + 1] + sRed[4 * r + 2] + sRed[4 * r + 3]
            if cutlass.const_expr(cfg.v_token):
                for j in cutlass.range_constexpr(cfg.NJV):
                    o = 4 * 16 * (1 + j) + 4 * r
                    sFinal[32 + j * 16 + r] = sRed[o] + sRed[o + 1] + sRed[o + 2] + sRed[o + 3]
        for r in cutlass.range_constexpr(N):
            if t == r:
                sFinal[16 + r] = m_run[r]
        cute.arch.barrier(barrier_id=BAR_FINAL, number_of_threads=2 * WG)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def output(
        self, sAlpha, sPsum, sFinal, sVp, st_ch, o_ch, tmem_holder, acc_layout, o_ptr, lse_ptr, len_ptr,
        b, h, split, kv_heads, num_splits, t, wq, nd: cutlass.Constexpr,
    ):
        """Output warpgroup: thread t owns channels d = t + 128*mt (t < head_dim), all N query rows."""
        cfg = self.cfg
        N, NM, D, R = cfg.N, cfg.NM, cfg.D, cfg.R
        Hq = kv_heads * R
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, 16, tmem_holder)
        t2r, thr_t2r = _t2r(tmem_ptr, acc_layout, t, NM)
        n_steps = _geometry(len_ptr, b, split, num_splits)[4]
        sVpH = cute.recast_ptr(sVp.iterator, dtype=Float16)
        accO = cute.make_rmem_tensor((cfg.MT * N,), Float32)
        for x in cutlass.range_constexpr(cfg.MT * N):
            accO[x] = Float32(0.0)
        dt = t % cfg.DM  # head_dim 64: rows 64..127 of the accumulators are unused
        for step in cutlass.range(0, n_steps, 1, unroll=1):
            sO = pl.stage(step, cfg.O_STAGES)
            sp = pl.stage(step, cfg.P_BUFS)
            pl.wait_full(st_ch, cfg.P_BUFS, step)  # alpha, P unscale, Psum, channel-wise V params of this step (softmax)
            pl.wait_full(o_ch, cfg.O_STAGES, step)  # PV of this step in TMEM (tcgen05.commit)
            tcgen05_fence_after()
            o_base = tmem_ptr + cfg.S_STAGES * cfg.S_COLS + sO * cfg.O_COLS
            for mt in cutlass.range_constexpr(cfg.MT):
                d = mt * cfg.DM + dt
                if cutlass.const_expr(cfg.v_token):
                    # one channel block per warp (groups are >= 32 channels): its accumulator only
                    for jl in cutlass.range_constexpr(cfg.JPM):
                        if (wq * 32) % cfg.DM // min(cfg.GV, cfg.DM) == jl:
                            acc = _load_acc(t2r, thr_t2r, cute.make_tensor(o_base + (mt * cfg.JPM + jl) * NM, acc_layout), NM)
                            cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld
                            unscale = sAlpha[sp * 32 + 16 + _v_block(cfg, mt, jl)]
                            for r in cutlass.range_constexpr(N):
                                accO[mt * N + r] = accO[mt * N + r] * sAlpha[sp * 32 + r] + (acc[r] + acc[N + r]) * unscale
                else:
                    upd = cute.make_rmem_tensor((N,), Float32)
                    for r in cutlass.range_constexpr(N):
                        upd[r] = Float32(0.0)
                    for tv in cutlass.range_constexpr(cfg.NTV):
                        vp = cute.make_tensor(sVpH + 2 * (sp * cfg.VP_WORDS + tv * D + d), cute.make_layout((2,)))
                        vs = vp[0].to(Float32) * sAlpha[sp * 32 + 16]
                        vz = vp[1].to(Float32)
                        acc = _load_acc(t2r, thr_t2r, cute.make_tensor(o_base + (mt * cfg.JPM + tv) * NM, acc_layout), NM)
                        cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld
                        w0, w1 = tv * min(cfg.GV, STEP) // 32, (tv + 1) * min(cfg.GV, STEP) // 32  # warps of group tv
                        for r in cutlass.range_constexpr(N):
                            ps = Float32(0.0)
                            for w in cutlass.range_constexpr(w0, w1):
                                ps = ps + sPsum[sp * 64 + w * 16 + r]
                            upd[r] = upd[r] + vs * (acc[r] + acc[N + r]) + vz * ps
                    for r in cutlass.range_constexpr(N):
                        accO[mt * N + r] = accO[mt * N + r] * sAlpha[sp * 32 + r] + upd[r]
            tcgen05_fence_before()
            pl.release(o_ch, cfg.O_STAGES, step)  # O stage free for the PV of step + O_STAGES
            pl.release(st_ch, cfg.P_BUFS, step)
        cute.arch.barrier(barrier_id=BAR_FINAL, number_of_threads=2 * WG)
        # ---- epilogue: add the token-wise V offset term of the channel's block, normalise, write
        for r in cutlass.range_constexpr(N):
            if r < R:
                lt = sFinal[r]
                has = lt > Float32(0.0)
                inv_l = fsel(has, cute.arch.rcp_approx(lt), Float32(0.0))
                obase, lidx = output_offsets(cfg.split, (b * Hq + h * R + r).to(Int64), split, num_splits, D)
                if t == 0:
                    lse = fsel(has, (sFinal[16 + r] + cute.math.log2(lt, fastmath=True)) * LN2, Float32(NEG_INF))
                    _scalar(lse_ptr, lidx)[0] = lse
                if t < cfg.DM:
                    for mt in cutlass.range_constexpr(cfg.MT):
                        d = mt * cfg.DM + t
                        val = accO[mt * N + r]
                        if cutlass.const_expr(cfg.v_token):
                            cv = Float32(0.0)
                            for j in cutlass.range_constexpr(cfg.NJV):
                                cv = fsel(d // cfg.GV == j, sFinal[32 + j * 16 + r], cv)
                            val = val + cv
                        val = val * inv_l
                        if cutlass.const_expr(cfg.split):
                            _scalar(o_ptr, obase + d)[0] = val
                        else:
                            _scalar(o_ptr, obase + d)[0] = val.to(cfg.q_dtype)

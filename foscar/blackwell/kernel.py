"""Blackwell (sm_100a) fused decode attention over a paged INT2/INT4 KV cache (affine folding).

Same algorithm, plan and cache tensors as ``foscar.hopper`` (design.md: the four folding cases);
only the arch parts differ. One CTA = one (split, kv_head, batch); it walks its token range in
*steps* of 128 tokens (two 64-token packed tiles), swap-AB so the cache is the tcgen05 A operand
(M = 128 tokens for QK, M = 128 channels per m-tile for PV) and the query heads are N:

    S^T [128 tokens   x NM] = K_step  [128 x D]   . Q^T [D x NM]     (acc in TMEM)
    O^T [128 channels x NM] = V^T_step[128 x 128] . P^T [128 x NM]   (acc in TMEM, per m-tile)

A (K, V^T) is built in shared memory from packed codes by the preparation warpgroup
(``foscar.layouts.blackwell`` word order, ``foscar.blackwell.operands`` recipes: INT2 -> FP4 E2M1
``c/2``, INT4 -> FP8 E4M3 ``c*2^-9``, 3 ALU instructions per word). B (Q^T or P^T, FP8 E4M3) is
hi/lo split: columns 0..N-1 hold ``fp8(x)``, columns N..2N-1 ``fp8(x - fp8(x))``, so one MMA with
``NM = 2N`` columns carries ~8 mantissa bits of Q and P (FP8 alone has 3); the softmax and output
warpgroups add the two halves. ``x`` is scaled by a power of two into [128, 256) first (Q: per
query row; P*s': per step and channel block) and the MMA result is unscaled exactly.

Warp roles (512 threads, design.md):
  * WG0, warp 0: TMEM allocation, tcgen05.mma issue, tcgen05.commit -> mbarriers.
  * WG1 (prep): packed words from global -> FP4/FP8 A operands in smem; Q^T (hi/lo) once.
  * WG2 (softmax): S from TMEM (tcgen05.ld, thread = token), K scales and offset corrections in
    FP32, online softmax (log2 domain), P^T hi/lo (scaled per channel block for token-wise V) to smem.
  * WG3 (output): PV from TMEM (thread = channel), V scales/corrections, rescale-and-accumulate O
    in registers, epilogue.

Structure of this version: the roles hand over through two CTA-wide named barriers and two
mbarriers per step (no multi-stage ring yet, so roles do not overlap across steps), and the prep
warpgroup reads codes with plain vectorized loads instead of TMA. Output format as Hopper:
``o [B, Hq, D]`` (q dtype) + ``lse [B, Hq]``, or fp32 partials ``o [B, Hq, S, D]``, ``lse [B, Hq, S]``.

Cases implemented in this version: K token-wise, V token-wise (any G dividing D), head_dim 128 or
256, gqa_ratio <= 16 (NM = 16 or 32), page sizes 64/128/256, INT2 and INT4.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import BFloat16, Float4E2M1FN, Float8E4M3FN, Float16, Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

from ..layouts.blackwell import BlackwellTile
from ..layouts.fragment import TILE_TOKENS
from ..scheme import Axis, Scheme
from .operands import construction_for

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")
STEP = 2 * TILE_TOKENS  # tokens per MMA step (M = 128)
WG = 128
# warpgroup roles
WG_MMA, WG_PREP, WG_SOFTMAX, WG_OUTPUT = 0, 1, 2, 3
# named barriers (0 = sync_threads)
BAR_OPERANDS = 1  # all 512: A and B of the QK step are in smem; previous PV consumed
BAR_P = 2  # all 512: P^T in smem
BAR_SOFTMAX = 3  # softmax warpgroup internal
BAR_PREP = 4  # preparation warpgroup internal
BAR_FINAL = 5  # softmax + output warpgroups: final reductions done
FP8_TARGET_EXP = 7  # scale hi/lo operands so their max lies in [2^7, 2^8)
TMEM_COLS = 512


class BlackwellConfig:
    """Static configuration derived from a Scheme and a page size (compile-time)."""

    def __init__(self, scheme: Scheme, page_size: int, split: bool):
        import torch

        if page_size not in (64, 128, 256):
            raise ValueError(f"page_size must be 64, 128 or 256, got {page_size}")
        if not 1 <= scheme.gqa_ratio <= 16:
            raise NotImplementedError("the Blackwell kernel supports gqa_ratio 1..16")
        if scheme.head_dim not in (128, 256):
            raise NotImplementedError("the Blackwell kernel supports head_dim 128 and 256 (64 needs M=64 TMEM layouts)")
        if scheme.k.axis is not Axis.TOKEN or scheme.v.axis is not Axis.TOKEN:
            raise NotImplementedError("this version of the Blackwell kernel implements token-wise K and V")
        self.scheme = scheme
        self.page_size = page_size
        self.split = bool(split)
        self.bits = scheme.bits
        self.D = scheme.head_dim
        self.R = scheme.gqa_ratio
        self.N = 8 if self.R <= 8 else 16  # query columns (padded)
        self.NM = 2 * self.N  # MMA N: hi and lo halves
        self.con = construction_for(self.bits)
        self.a_inv = float(1 / self.con.a)  # scale fold: s' = s / a (construction bias b = 0)
        self.op_dtype = Float4E2M1FN if self.bits == 2 else Float8E4M3FN
        self.ktile = BlackwellTile("k", self.bits, self.D)
        self.vtile = BlackwellTile("v", self.bits, self.D)
        self.TW = self.ktile.words
        self.E = self.ktile.elems_per_word
        self.mask = self.ktile.mask
        self.SUB = page_size // TILE_TOKENS
        self.MT = self.D // 128  # m-tiles of V^T
        self.KB_D = self.D // 32  # MMA k-blocks (K = 32) over head_dim
        self.KB_S = STEP // 32  # over a step's tokens
        self.GK, self.GV = scheme.k.group, scheme.v.group
        self.NJK = self.D // self.GK
        self.NJV = self.D // self.GV
        self.q_dtype = BFloat16 if scheme.q_dtype == torch.bfloat16 else Float16
        self.threads = 4 * WG


def _fsel(cond, a, b):
    return Float32(cutlass.select_(cond, Float32(a), Float32(b)))


def _pow2_scale(x):
    """2^(FP8_TARGET_EXP - floor(log2 x)) for x > 0 (1 for x = 0): puts x into [2^7, 2^8).

    Built with exp2 of an integer (exact); x's exponent comes from log2 rounded down.
    """
    e = cute.math.floor(cute.math.log2(cute.arch.fmax(x, Float32(1e-30)), fastmath=True))
    return cute.math.exp2(Float32(FP8_TARGET_EXP) - e, fastmath=True)


def _swizzle(off, b: int, m: int, s: int):
    """CuTe Swizzle<b, m, s> of an offset: bits [m+s, m+s+b) XORed into [m, m+b)."""
    mask = ((1 << b) - 1) << (m + s)
    return off ^ ((off & mask) >> s)


def _tile_head(pt_ptr, b, max_pages, kv_heads, h, n_tiles, tile, page_size: int):
    """(page * kv_heads + h, tile-in-page, first slot) of 64-token tile ``tile`` (clamped in range)."""
    tile = cutlass.min(tile, n_tiles - 1)
    tok0 = tile * TILE_TOKENS
    page = cute.make_tensor(pt_ptr + (b.to(Int64) * max_pages + tok0 // page_size), cute.make_layout((1,)))[0]
    return page.to(Int64) * kv_heads + h, (tok0 % page_size) // TILE_TOKENS, tok0 % page_size


def _store_chunk(width: int, base, outer, swz, m, k, stage, lo, hi):
    """8 operand bytes (consecutive K elements of row m from column k) into a swizzled A buffer.

    ``outer``: the ((128,32),1,KB,STAGE) smem layout (element units), ``swz`` its swizzle, ``base``
    the buffer as an Int32 pointer. One 8-byte chunk never straddles a swizzle unit.
    """
    e = cute.crd2idx(((m, k % 32), 0, k // 32, stage), outer)
    e = _swizzle(e, swz.num_bits, swz.num_base, swz.num_shift)
    dst = cute.make_tensor(base + (e * width) // 32, cute.make_layout((2,)))
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
        kp_ptr: cute.Pointer,  # fp16 [P, H, PS, D/G, 2]
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
        # Tiled MMA: A (codes -> FP4/FP8) K-major from smem, B (FP8 hi/lo) K-major, acc F32 in TMEM
        ##############################################################################
        tiled_mma = sm100_utils.make_trivial_tiled_mma(
            cfg.op_dtype,
            Float8E4M3FN,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Float32,
            tcgen05.CtaGroup.ONE,
            (STEP, cfg.NM),
        )
        # (MMA, MMA_M, MMA_K, STAGE): K step [128 tokens x D]
        sK_layout = sm100_utils.make_smem_layout_a(tiled_mma, (STEP, cfg.NM, cfg.D), cfg.op_dtype, 1)
        # V^T step [128 channels x 128 tokens], one stage per m-tile
        sV_layout = sm100_utils.make_smem_layout_a(tiled_mma, (STEP, cfg.NM, STEP), cfg.op_dtype, cfg.MT)
        # Q^T [NM x D] and P^T [NM x 128 tokens] (one stage per V channel block)
        sQ_layout = sm100_utils.make_smem_layout_b(tiled_mma, (STEP, cfg.NM, cfg.D), Float8E4M3FN, 1)
        sP_layout = sm100_utils.make_smem_layout_b(tiled_mma, (STEP, cfg.NM, STEP), Float8E4M3FN, cfg.NJV)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_addr: cute.struct.MemRange[Int32, 1]
            sK: cute.struct.Align[cute.struct.MemRange[cfg.op_dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[cfg.op_dtype, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sQ_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sP_layout)], 1024]
            # per query column: unscale of S (2^-e_r * scale_log2), Qsum[j], alpha, P unscale per j
            sQinfo: cute.struct.Align[cute.struct.MemRange[Float32, 16 * (1 + cfg.NJK)], 16]
            sAlpha: cute.struct.Align[cute.struct.MemRange[Float32, 16 + cfg.NJV], 16]
            sRed: cute.struct.Align[cute.struct.MemRange[Float32, 4 * 16 * (1 + cfg.NJV)], 16]
            sFinal: cute.struct.Align[cute.struct.MemRange[Float32, 16 * (2 + cfg.NJV)], 16]

        scale_log2 = sm_scale * LOG2E
        self.kernel(
            tiled_mma, sK_layout, sV_layout, sQ_layout, sP_layout, SharedStorage,
            q_ptr, kc_ptr, kp_ptr, vc_ptr, vp_ptr, pt_ptr, len_ptr, o_ptr, lse_ptr,
            kv_heads, max_pages, num_splits, scale_log2,
        ).launch(
            grid=(num_splits, kv_heads, batch),
            block=(cfg.threads, 1, 1),
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
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
        N, NM, D, R = cfg.N, cfg.NM, cfg.D, cfg.R
        tidx, _, _ = cute.arch.thread_idx()
        split, h, b = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        role = warp // 4
        t = tidx % WG  # thread within its warpgroup
        lane = tidx % 32
        wq = (tidx // 32) % 4  # warp within its warpgroup

        # ---------------------------------------------------------------- shared memory
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (MMA, MMA_M, MMA_K, 1)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)  # (MMA, MMA_M, MMA_K, MT)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (MMA, MMA_N, MMA_K, 1)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)  # (MMA, MMA_N, MMA_K, NJV)
        sQinfo = storage.sQinfo.get_tensor(cute.make_layout(16 * (1 + cfg.NJK)))
        sAlpha = storage.sAlpha.get_tensor(cute.make_layout(16 + cfg.NJV))
        sRed = storage.sRed.get_tensor(cute.make_layout(4 * 16 * (1 + cfg.NJV)))
        sFinal = storage.sFinal.get_tensor(cute.make_layout(16 * (2 + cfg.NJV)))
        mbar_s = storage.mbar.data_ptr()
        mbar_o = storage.mbar.data_ptr() + 1

        # ---------------------------------------------------------------- barriers + TMEM
        if tidx == 0:
            cute.arch.mbarrier_init(mbar_s, 1)
            cute.arch.mbarrier_init(mbar_o, 1)
            cute.arch.mbarrier_init_fence()
        tmem_holder = storage.tmem_addr.data_ptr()
        if warp == 0:
            cute.arch.alloc_tmem(TMEM_COLS, tmem_holder)
        cute.arch.sync_threads()
        tmem_ptr = cute.arch.retrieve_tmem_ptr(Float32, 16, tmem_holder)

        # ---------------------------------------------------------------- MMA partitions
        thr_mma = tiled_mma.get_slice(0)
        tCrK = tiled_mma.make_fragment_A(sK)  # descriptors (MMA, 1, KB_D, 1)
        tCrV = tiled_mma.make_fragment_A(sV)  # (MMA, 1, KB_S, MT)
        tCrQ = tiled_mma.make_fragment_B(sQ)  # (MMA, 1, KB_D, 1)
        tCrP = tiled_mma.make_fragment_B(sP)  # (MMA, 1, KB_S, NJV)
        acc_shape = thr_mma.partition_shape_C((STEP, NM))  # ((128, NM), 1, 1)
        acc_layout = tiled_mma.make_fragment_C(acc_shape).layout
        # TMEM columns: S accumulators (one per K channel block j), then PV (per m-tile, V block j)
        tS = [cute.make_tensor(tmem_ptr + j * NM, acc_layout) for j in range(cfg.NJK)]
        o_col0 = cfg.NJK * NM
        tO = [[cute.make_tensor(tmem_ptr + o_col0 + (mt * cfg.NJV + j) * NM, acc_layout) for j in range(cfg.NJV)]
              for mt in range(cfg.MT)]
        # TMEM -> registers: thread t of a warpgroup reads lane t (row t), NM fp32 columns
        t2r_atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(NM)), Float32)
        t2r = tcgen05.make_tmem_copy(t2r_atom, tS[0][(None, None), 0, 0])
        thr_t2r = t2r.get_slice(t)

        # ---------------------------------------------------------------- geometry
        Hq = kv_heads * R
        length = cute.make_tensor(len_ptr + b, cute.make_layout((1,)))[0]
        n_tiles = (length + TILE_TOKENS - 1) // TILE_TOKENS
        per_split = (n_tiles + num_splits - 1) // num_splits
        per_split = per_split + per_split % 2  # whole 128-token steps per split
        t_begin = split * per_split
        t_end = cutlass.min(t_begin + per_split, n_tiles)
        n_steps = (t_end - t_begin + 1) // 2
        q_base = (b * Hq + h * R).to(Int64) * D

        E = cfg.E
        width = 4 if cfg.bits == 2 else 8
        vec_per_thread = cfg.TW // 4 // WG  # 16-byte vectors per thread per tile
        ku32 = cute.recast_ptr(storage.sK.data_ptr(), dtype=Int32)
        vu32 = cute.recast_ptr(storage.sV.data_ptr(), dtype=Int32)
        ksw, vsw = sK_layout.inner, sV_layout.inner

        # ================================================================ roles
        if role == WG_PREP:
            # ---- Q^T hi/lo once: thread t owns channels d = t + 128*i of every query row
            nd = D // WG
            for r in cutlass.range_constexpr(N):
                rr = min(r, R - 1)
                qv = cute.make_rmem_tensor((nd,), Float32)
                amax = Float32(0.0)
                for i in cutlass.range_constexpr(nd):
                    x = cute.make_tensor(q_ptr + (q_base + rr * D + t + WG * i), cute.make_layout((1,)))[0].to(Float32)
                    qv[i] = x if r < R else Float32(0.0)
                    amax = cute.arch.fmax(amax, cute.arch.fmax(qv[i], -qv[i]))
                amax = cute.arch.warp_reduction(amax, cute.arch.fmax)
                if lane == 0:
                    sRed[4 * r + wq] = amax
                cute.arch.barrier(barrier_id=BAR_PREP, number_of_threads=WG)
                amax = cute.arch.fmax(cute.arch.fmax(sRed[4 * r], sRed[4 * r + 1]), cute.arch.fmax(sRed[4 * r + 2], sRed[4 * r + 3]))
                sc = _pow2_scale(amax)
                for i in cutlass.range_constexpr(nd):
                    d = t + WG * i
                    x = qv[i] * sc
                    qhi = x.to(Float8E4M3FN)
                    qlo = (x - qhi.to(Float32)).to(Float8E4M3FN)
                    sQ[((r, d % 32), 0, d // 32, 0)] = qhi
                    sQ[((N + r, d % 32), 0, d // 32, 0)] = qlo
                if t == 0:
                    sQinfo[r] = scale_log2 / sc  # S unscale, log2(e)*sm_scale folded in
            # Qsum[r][j] of the unrounded q (offset correction of token-wise K), one (r, j) per thread
            for x in cutlass.range_constexpr(N * cfg.NJK):
                if t == x:
                    r, j = x // cfg.NJK, x % cfg.NJK
                    rr = min(r, R - 1)
                    acc = Float32(0.0)
                    for c in cutlass.range(j * cfg.GK, (j + 1) * cfg.GK, 1, unroll=8):
                        acc = acc + cute.make_tensor(q_ptr + (q_base + rr * D + c), cute.make_layout((1,)))[0].to(Float32)
                    sQinfo[16 + x] = acc * scale_log2 if r < R else Float32(0.0)
            # ---- per step: K and V^T operands from packed words
            for step in cutlass.range(0, n_steps, 1, unroll=1):
                if step > 0:
                    cute.arch.mbarrier_wait(mbar_o, (step - 1) % 2)  # previous PV has read sK/sV
                for half in cutlass.range_constexpr(2):
                    head, sub, _slot = _tile_head(pt_ptr, b, max_pages, kv_heads, h, n_tiles, t_begin + 2 * step + half, cfg.page_size)
                    off = cute.assume((head * cfg.SUB + sub) * cfg.TW, divby=4)  # tiles: 16-byte blocks
                    for is_v in cutlass.range_constexpr(2):
                        c_ptr = vc_ptr if is_v else kc_ptr
                        # (4 words, thread, vector): vector j of thread t = tile vector j*128 + t
                        src = cute.make_tensor(c_ptr + off, cute.make_layout((4, WG, vec_per_thread), stride=(1, 4, 4 * WG)))
                        words = cute.make_rmem_tensor((4, vec_per_thread), Int32)
                        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128)
                        cute.copy(atom, src[None, t, None], words)
                        cpr = (TILE_TOKENS if is_v else D) // E  # chunks per row
                        for v in cutlass.range_constexpr(vec_per_thread):
                            for wi in cutlass.range_constexpr(4):
                                w = Uint32(words[wi, v])
                                # the recipe (foscar.blackwell.operands): lo = w & MASK, hi = (w >> bits) & MASK
                                lo = Int32(cute.arch.lop3(w, Uint32(cfg.mask), Uint32(0), 0xC0))
                                hi = Int32(cute.arch.lop3(w >> cfg.bits, Uint32(cfg.mask), Uint32(0), 0xC0))
                                n = (v * WG + t) * 4 + wi  # word of the tile: (row, chunk) row-major
                                row = n // cpr
                                col = (n % cpr) * E
                                if cutlass.const_expr(is_v):  # V^T: row = channel, K mode = token
                                    _store_chunk(width, vu32, sV_layout.outer, vsw, row % 128, col + TILE_TOKENS * half, row // 128, lo, hi)
                                else:  # K: row = token, K mode = channel
                                    _store_chunk(width, ku32, sK_layout.outer, ksw, row + TILE_TOKENS * half, col, 0, lo, hi)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=BAR_OPERANDS, number_of_threads=cfg.threads)
                cute.arch.barrier(barrier_id=BAR_P, number_of_threads=cfg.threads)

        if role == WG_MMA:
            for step in cutlass.range(0, n_steps, 1, unroll=1):
                cute.arch.barrier(barrier_id=BAR_OPERANDS, number_of_threads=cfg.threads)
                if warp == 0:
                    # S^T_j = K[:, block j] . Q^T[block j, :]  (one TMEM accumulator per channel block)
                    for j in cutlass.range_constexpr(cfg.NJK):
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                        for kb in cutlass.range_constexpr(j * cfg.GK // 32, (j + 1) * cfg.GK // 32):
                            cute.gemm(tiled_mma, tS[j], tCrK[None, None, kb, 0], tCrQ[None, None, kb, 0], tS[j])
                            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    with cute.arch.elect_one():
                        tcgen05.commit(mbar_s)
                cute.arch.barrier(barrier_id=BAR_P, number_of_threads=cfg.threads)
                if warp == 0:
                    # O^T_{mt,j} = V^T[m-tile mt] . (P^T scaled for channel block j)
                    for mt in cutlass.range_constexpr(cfg.MT):
                        for j in cutlass.range_constexpr(cfg.NJV):
                            if cutlass.const_expr((mt * 128) // cfg.GV <= j < ((mt + 1) * 128 + cfg.GV - 1) // cfg.GV):
                                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                                for kb in cutlass.range_constexpr(cfg.KB_S):
                                    cute.gemm(tiled_mma, tO[mt][j], tCrV[None, None, kb, mt], tCrP[None, None, kb, j], tO[mt][j])
                                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    with cute.arch.elect_one():
                        tcgen05.commit(mbar_o)

        # running state of the softmax warpgroup (per query column, all threads hold all columns)
        if role == WG_SOFTMAX:
            m_run = cute.make_rmem_tensor((N,), Float32)
            l_run = cute.make_rmem_tensor((N,), Float32)  # per-thread partial (one token per step)
            corr = cute.make_rmem_tensor((cfg.NJV * N,), Float32)  # per-thread sum_l z'[l,j] p[l]
            for r in cutlass.range_constexpr(N):
                m_run[r] = Float32(NEG_INF)
                l_run[r] = Float32(0.0)
            for x in cutlass.range_constexpr(cfg.NJV * N):
                corr[x] = Float32(0.0)
            for step in cutlass.range(0, n_steps, 1, unroll=1):
                cute.arch.barrier(barrier_id=BAR_OPERANDS, number_of_threads=cfg.threads)
                tile = t_begin + 2 * step + t // TILE_TOKENS
                head, _sub, slot0 = _tile_head(pt_ptr, b, max_pages, kv_heads, h, n_tiles, tile, cfg.page_size)
                tok = tile * TILE_TOKENS + t % TILE_TOKENS
                ok = (tok < length) & (tile < t_end)
                # K parameters of token t: s' = s/a * scale_log2 folded later; z' = z (bias 0)
                pb = ((head * cfg.page_size + slot0 + t % TILE_TOKENS) * cfg.NJK) * 2
                vb = ((head * cfg.page_size + slot0 + t % TILE_TOKENS) * cfg.NJV) * 2
                cute.arch.mbarrier_wait(mbar_s, step % 2)
                sc = cute.make_rmem_tensor((N,), Float32)
                for r in cutlass.range_constexpr(N):
                    sc[r] = Float32(0.0)
                for j in cutlass.range_constexpr(cfg.NJK):
                    kp = cute.make_tensor(kp_ptr + (pb + 2 * j), cute.make_layout((2,)))
                    ks = kp[0].to(Float32) * cfg.a_inv
                    kz = kp[1].to(Float32)
                    acc = _load_acc(t2r, thr_t2r, tS[j], NM)  # (NM,): hi columns then lo columns
                    for r in cutlass.range_constexpr(N):
                        sc[r] = sc[r] + ks * (acc[r] + acc[N + r]) * sQinfo[r] + kz * sQinfo[16 + r * cfg.NJK + j]
                cute.arch.fence_view_async_tmem_load()
                # column max over the 128 tokens of the step
                for r in cutlass.range_constexpr(N):
                    sc[r] = _fsel(ok, sc[r], Float32(NEG_INF))
                    mx = cute.arch.warp_reduction(sc[r], cute.arch.fmax)
                    if lane == 0:
                        sRed[4 * r + wq] = mx
                # max over tokens of the V scales per channel block (hi/lo normalisation of P*s')
                vs = cute.make_rmem_tensor((cfg.NJV,), Float32)
                vz = cute.make_rmem_tensor((cfg.NJV,), Float32)
                for j in cutlass.range_constexpr(cfg.NJV):
                    vp = cute.make_tensor(vp_ptr + (vb + 2 * j), cute.make_layout((2,)))
                    vs[j] = _fsel(ok, vp[0].to(Float32) * cfg.a_inv, Float32(0.0))
                    vz[j] = _fsel(ok, vp[1].to(Float32), Float32(0.0))
                    mv = cute.arch.warp_reduction(vs[j], cute.arch.fmax)
                    if lane == 0:
                        sRed[4 * 16 * (1 + j) + wq] = mv
                cute.arch.barrier(barrier_id=BAR_SOFTMAX, number_of_threads=WG)
                pscale = cute.make_rmem_tensor((cfg.NJV,), Float32)
                for j in cutlass.range_constexpr(cfg.NJV):
                    o = 4 * 16 * (1 + j)
                    mv = cute.arch.fmax(cute.arch.fmax(sRed[o], sRed[o + 1]), cute.arch.fmax(sRed[o + 2], sRed[o + 3]))
                    pscale[j] = _pow2_scale(mv)
                    if t == 0:
                        sAlpha[16 + j] = cute.arch.rcp_approx(pscale[j])  # exact for a power of two
                for r in cutlass.range_constexpr(N):
                    mx = cute.arch.fmax(cute.arch.fmax(sRed[4 * r], sRed[4 * r + 1]), cute.arch.fmax(sRed[4 * r + 2], sRed[4 * r + 3]))
                    m_new = cute.arch.fmax(m_run[r], mx)
                    m_use = _fsel(m_new == Float32(NEG_INF), Float32(0.0), m_new)
                    alpha = cute.math.exp2(m_run[r] - m_use, fastmath=True)
                    m_run[r] = m_new
                    p = cute.math.exp2(sc[r] - m_use, fastmath=True)
                    l_run[r] = l_run[r] * alpha + p
                    if t == 0:
                        sAlpha[r] = alpha
                    for j in cutlass.range_constexpr(cfg.NJV):
                        corr[j * N + r] = corr[j * N + r] * alpha + p * vz[j]
                        x = p * vs[j] * pscale[j]
                        phi = x.to(Float8E4M3FN)
                        plo = (x - phi.to(Float32)).to(Float8E4M3FN)
                        sP[((r, t % 32), 0, t // 32, j)] = phi
                        sP[((N + r, t % 32), 0, t // 32, j)] = plo
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=BAR_P, number_of_threads=cfg.threads)
                cute.arch.mbarrier_wait(mbar_o, step % 2)
            # ---- final: l and the V offset corrections, reduced over the 128 threads
            for r in cutlass.range_constexpr(N):
                ls = cute.arch.warp_reduction(l_run[r], lambda a, c: a + c)
                if lane == 0:
                    sRed[4 * r + wq] = ls
                for j in cutlass.range_constexpr(cfg.NJV):
                    cs = cute.arch.warp_reduction(corr[j * N + r], lambda a, c: a + c)
                    if lane == 0:
                        sRed[4 * 16 * (1 + j) + 4 * r + wq] = cs
            cute.arch.barrier(barrier_id=BAR_SOFTMAX, number_of_threads=WG)
            if t < N:
                r = t
                sFinal[r] = sRed[4 * r] + sRed[4 * r + 1] + sRed[4 * r + 2] + sRed[4 * r + 3]
                for j in cutlass.range_constexpr(cfg.NJV):
                    o = 4 * 16 * (1 + j) + 4 * r
                    sFinal[32 + j * 16 + r] = sRed[o] + sRed[o + 1] + sRed[o + 2] + sRed[o + 3]
            for r in cutlass.range_constexpr(N):
                if t == r:
                    sFinal[16 + r] = m_run[r]
            cute.arch.barrier(barrier_id=BAR_FINAL, number_of_threads=2 * WG)

        if role == WG_OUTPUT:
            # thread t owns channels d = t + 128*mt, all N query columns, in registers
            accO = cute.make_rmem_tensor((cfg.MT * N,), Float32)
            for x in cutlass.range_constexpr(cfg.MT * N):
                accO[x] = Float32(0.0)
            for step in cutlass.range(0, n_steps, 1, unroll=1):
                cute.arch.barrier(barrier_id=BAR_OPERANDS, number_of_threads=cfg.threads)
                cute.arch.barrier(barrier_id=BAR_P, number_of_threads=cfg.threads)
                cute.arch.mbarrier_wait(mbar_o, step % 2)
                for mt in cutlass.range_constexpr(cfg.MT):
                    for j in cutlass.range_constexpr(cfg.NJV):
                        if cutlass.const_expr((mt * 128) // cfg.GV <= j < ((mt + 1) * 128 + cfg.GV - 1) // cfg.GV):
                            d_w = mt * 128 + wq * 32  # first channel of this warp (warp-uniform block)
                            if d_w // cfg.GV == j if cfg.GV >= 32 else True:
                                acc = _load_acc(t2r, thr_t2r, tO[mt][j], NM)
                                unscale = sAlpha[16 + j]
                                for r in cutlass.range_constexpr(N):
                                    accO[mt * N + r] = accO[mt * N + r] * sAlpha[r] + (acc[r] + acc[N + r]) * unscale
                cute.arch.fence_view_async_tmem_load()
            cute.arch.barrier(barrier_id=BAR_FINAL, number_of_threads=2 * WG)
            # ---- epilogue: add the V offset correction of the channel's block, normalise, write
            for r in cutlass.range_constexpr(N):
                if r < R:
                    lt = sFinal[r]
                    has = lt > Float32(0.0)
                    inv_l = _fsel(has, cute.arch.rcp_approx(lt), Float32(0.0))
                    hq = (b * Hq + h * R + r).to(Int64)
                    if cutlass.const_expr(cfg.split):
                        obase = (hq * num_splits + split) * D
                        lidx = hq * num_splits + split
                    else:
                        obase = hq * D
                        lidx = hq
                    if t == 0:
                        lse = _fsel(has, (sFinal[16 + r] + cute.math.log2(lt, fastmath=True)) * LN2, Float32(NEG_INF))
                        cute.make_tensor(lse_ptr + lidx, cute.make_layout((1,)))[0] = lse
                    for mt in cutlass.range_constexpr(cfg.MT):
                        d = t + 128 * mt
                        cv = Float32(0.0)
                        for j in cutlass.range_constexpr(cfg.NJV):
                            cv = _fsel(d // cfg.GV == j, sFinal[32 + j * 16 + r], cv)
                        val = (accO[mt * N + r] + cv) * inv_l
                        if cutlass.const_expr(cfg.split):
                            cute.make_tensor(o_ptr + (obase + d), cute.make_layout((1,)))[0] = val
                        else:
                            cute.make_tensor(o_ptr + (obase + d), cute.make_layout((1,)))[0] = val.to(cfg.q_dtype)

        cute.arch.sync_threads()
        if warp == 0:
            cute.arch.dealloc_tmem(tmem_ptr, TMEM_COLS)

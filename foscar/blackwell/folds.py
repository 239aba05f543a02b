"""Blackwell (sm_100a) device hooks of the four fold cases (``foscar.folds``).

One class per case, registered against the case class (:func:`hooks_for`); the decode kernel
(``foscar.blackwell.kernel``) calls these hooks and never branches on the case. Each class owns
its slice of the kernel: the geometry it adds (accumulators, P stages, shared-memory areas), its
params loads (ring -> registers), where its scale is applied (the other operand before the MMA, or
the accumulator after it) and its offset correction:

===============  ==========================================  ===========================================
case             scale                                       offset correction
===============  ==========================================  ===========================================
K token-wise     S_j (one accumulator per channel block j)    z[l, j] * Qsum[j]          (softmax)
K channel-wise   Q' per token group t (prep, one MMA)         C[t] = sum_d z[d, t] q[d]  (prep, softmax)
V token-wise     P' per channel block j (one P stage each)    sum_l z[l, j] P[l]         (softmax, epilogue)
V channel-wise   the PV accumulator of token group t          z[d, t] * Psum[t]          (output)
===============  ==========================================  ===========================================

Hooks are plain methods (they run at trace time and emit the same IR as inline code); those with
runtime control flow (``if lane == 0``, dynamic loops) are ``@cute.jit``. Shared memory is the
kernel's namespace ``sm`` of named tensors (``sm.sQ``, ``sm.sRed``, ...), indexed through
``foscar.blackwell.storage``'s offset helpers.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32
from cutlass.pipeline import NamedBarrier

from ..barriers import BlackwellDecodeBarrier
from ..device import fsel, group_offset, group_params, group_scale, group_word
from ..folds import HookRegistry, KChannelWise, KTokenWise, VChannelWise, VTokenWise
from ..layouts.fragment import TILE_TOKENS
from ..pipeline import stage
from . import storage as sm_
from .primitives import (FP8_TARGET_EXP, STEP, WG, exp_floor, fabs, fp8_pieces, load_acc, max4, piece_sum,
                         pow2_scale, scalar)

HOOKS = HookRegistry("sm_100a")
register = HOOKS.register
hooks_for = HOOKS.hooks_for  # the Blackwell hooks of a plan's fold case for a kernel of config ``cfg``


class BlackwellFold:
    """Common state: the fold case and the kernel config (N, D, ring offsets, stage counts)."""

    def __init__(self, fold, cfg):
        self.fold = fold
        self.cfg = cfg

    @property
    def step_groups(self) -> int:
        """Groups of ``fold.group`` tokens in a 128-token step (a group longer than a step counts once)."""
        return max(1, STEP // self.fold.group)


# ================================================================================================ K
class KHooks(BlackwellFold):
    """K: S^T = K . Q'^T per step; ``scores`` returns S (log2 domain) of the thread's token."""

    s_blocks = 1  # S accumulators per step (channel blocks)
    q_copies = 1  # scaled Q' copies side by side along the QK MMA's N (token groups)
    qf_words = 0  # fp32 q kept in smem for per-step Q' (channel-wise)

    def store_q(self, sm, x, col, d, so):
        """Q' value ``x`` (|x| < 256) of channel ``d`` as its FP8 pieces (``cfg.PIECES``) in columns ``col + k * N``
        of Q'^T buffer ``so``."""
        for k, piece in enumerate(fp8_pieces(x, self.cfg.PIECES)):
            sm.sQ[((col + k * self.cfg.N, d % 32), 0, d // 32, so)] = piece

    def q_buffers(self, op_stages: int) -> int:
        """Q'^T smem buffers: one (Q' fixed) or one per operand stage (Q' per step)."""
        return 1

    def q_stage(self, so):
        """The Q'^T buffer the QK of operand stage ``so`` reads."""
        return 0

    def prep_step(self, kern, sm, ring, ring_words, step, so, scale_log2, t, lane, wq, nd):
        """Preparation warpgroup, per step before the operands (channel-wise K: Q' and C)."""

    def prep_sums(self, sm, q_ptr, q_base, kv_heads, scale_log2, t):
        """Preparation warpgroup, once after q is loaded (token-wise K: Qsum; ``q_base``: q of query column 0,
        the others ``cfg.rows.offset`` rows from it)."""

    def softmax_wait(self, opnd, step):
        """Softmax warpgroup: wait for what prep wrote for this step (channel-wise K: sKinfo; token-wise K: sQinfo of
        the prologue, which the chain prep -> MMA warp -> tcgen05.commit -> softmax orders only if the commit's arrive
        carries what the MMA thread acquired, which the PTX ISA leaves unsaid). Parity safe: prep cannot publish item
        step + OP_STAGES before the PV of this step, which needs this step's P."""
        opnd.wait_full(step)


@register(KTokenWise)
class BlackwellKTokenWise(KHooks):
    """Scale on S_j: one accumulator per channel block j; offset z[l, j] * Qsum[j]. Q' = Q is
    built once (in FP8 pieces) by the preparation warpgroup."""

    def __init__(self, fold, cfg):
        super().__init__(fold, cfg)
        self.s_blocks = fold.channel_blocks

    def prep_q_row(self, sm, qv, sc, r, t, nd):
        """Q^T of row r in its FP8 pieces, once (thread t owns channels (t + 128*i) % D)."""
        D = self.cfg.D
        for i in range(nd):
            d = (t + WG * i) % D
            self.store_q(sm, qv[i] * sc, r, d, 0)

    @cute.jit
    def prep_sums(self, sm, q_ptr, q_base, kv_heads, scale_log2, t):
        """Qsum[r][j] of the unrounded q (the offset correction), one (r, j) per thread."""
        cfg = self.cfg
        N, D, R, NJ, G = cfg.N, cfg.D, cfg.R, self.s_blocks, self.fold.group
        offset = cfg.rows.offset  # (a method of a local object is not called inside a runtime `if`)
        if t < N * NJ:
            r, j = t // NJ, t % NJ
            row = q_base + offset(cutlass.min(r, R - 1), kv_heads) * D
            acc = Float32(0.0)
            for c in cutlass.range(j * G, (j + 1) * G, 1, unroll=8):
                acc = acc + scalar(q_ptr, row + c)[0].to(Float32)
            sm.sQinfo[sm_.qsum_thread(t)] = fsel(r < R, acc * scale_log2, Float32(0.0))

    def scores(self, sm, prm, tmem_ptr, t2r, thr_t2r, acc_layout, ss, step, t, wq):
        """S[r] = sum_j s'[l, j] S_j[r] + z[l, j] Qsum[j, r] (token l = this thread)."""
        cfg = self.cfg
        N, NQK = cfg.N, cfg.NQK
        sc = cute.make_rmem_tensor((N,), Float32)
        for r in range(N):
            sc[r] = Float32(0.0)
        for j in range(self.s_blocks):
            kp, ks = group_scale(prm + self.fold.param_element((t % TILE_TOKENS) * self.s_blocks + j, cfg.K_PARAMS),
                                 self.fold)
            ks, kz = ks * cfg.k_a_inv, group_offset(kp, ks, self.fold)
            acc = load_acc(t2r, thr_t2r, cute.make_tensor(tmem_ptr + ss * cfg.S_COLS + j * NQK, acc_layout), NQK)
            cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before the registers are used
            for r in range(N):
                sc[r] = (sc[r] + ks * piece_sum(acc, r, N, cfg.PIECES) * sm.sQinfo[sm_.s_unscale(r)]
                         + kz * sm.sQinfo[sm_.qsum(r, j, self.s_blocks)])
        return sc


@register(KChannelWise)
class BlackwellKChannelWise(KHooks):
    """Scale on Q: Q'[t] = Q * s[:, t] * 2^-e_t per token group t of the step (side by side along
    N, one MMA); offset C[t] = sum_d z[d, t] q[d], both built per step by the preparation warpgroup."""

    def __init__(self, fold, cfg):
        super().__init__(fold, cfg)
        self.q_copies = self.step_groups
        self.qf_words = cfg.N * cfg.D

    def q_buffers(self, op_stages: int) -> int:
        return op_stages

    def q_stage(self, so):
        return so

    def prep_q_row(self, sm, qv, sc, r, t, nd):
        """q of row r kept in fp32 for the per-step Q' and C."""
        D = self.cfg.D
        for i in range(nd):
            d = (t + WG * i) % D
            sm.sQf[r * D + d] = qv[i]

    def prep_step(self, kern, sm, ring, ring_words, step, so, scale_log2, t, lane, wq, nd):
        kinfo = sm_.kinfo_stage(so)
        self.prep_q_scaled(sm, ring_words, step, so, kinfo, t, lane, wq, nd)
        self.prep_offset_terms(sm, kinfo, scale_log2, t)

    @cute.jit
    def prep_q_scaled(self, sm, ring_words, step, so, kinfo, t, lane, wq, nd: cutlass.Constexpr):
        """Q'[t] = Q * s[:, t] * 2^-e_t (its FP8 pieces, ``NM = PIECES * N`` columns per token group t side by side,
        operand stage so) and the S unscale 2^e_t / a; the group's (scale, offset) from the ring."""
        cfg = self.cfg
        N, NM, D, G = cfg.N, cfg.NM, cfg.D, self.fold.group
        NamedBarrier(BlackwellDecodeBarrier.PREP, WG).arrive_and_wait()  # previous step's sZ / sRed reads done
        ks = cute.make_rmem_tensor((self.q_copies * nd,), Float32)
        for tk in cutlass.range_constexpr(self.q_copies):
            off = tk * min(G, STEP)  # first token of group tk in the step
            grp = (off % TILE_TOKENS) // G if G < TILE_TOKENS else 0  # group within its tile
            tile_words = ring_words + cute.assume(stage(2 * step + off // TILE_TOKENS, cfg.RING) * cfg.STAGE_WORDS, divby=4)
            kp_ring = cute.recast_ptr(tile_words + cfg.K_PARAMS + grp * D * self.fold.param_fields // 2, dtype=Float16)
            smax = Float32(0.0)
            for i in cutlass.range_constexpr(nd):
                d = (t + WG * i) % D
                ks[tk * nd + i], sm.sZ[tk * D + d] = group_params(kp_ring + self.fold.param_element(d), self.fold)
                smax = cute.arch.fmax(smax, fabs(ks[tk * nd + i]))
            smax = cute.arch.warp_reduction(smax, cute.arch.fmax)
            if lane == 0:
                sm.sRedP[sm_.red_row(0, tk) + wq] = smax
        NamedBarrier(BlackwellDecodeBarrier.PREP, WG).arrive_and_wait()
        for tk in cutlass.range_constexpr(self.q_copies):
            e = exp_floor(max4(sm.sRedP, sm_.red_row(0, tk))) + Float32(1.0)  # max_d |s| < 2^e
            s_norm = cute.math.exp2(-e, fastmath=True)
            if t == 0:
                sm.sKinfo[sm_.k_unscale(kinfo, tk)] = cute.math.exp2(e, fastmath=True) * cfg.k_a_inv
            for r in cutlass.range_constexpr(N):
                qs = sm.sQinfo[sm_.q_scale(r)] * s_norm
                for i in cutlass.range_constexpr(nd):
                    d = (t + WG * i) % D
                    self.store_q(sm, sm.sQf[r * D + d] * qs * ks[tk * nd + i], tk * NM + r, d, so)  # |.| < 256
        NamedBarrier(BlackwellDecodeBarrier.PREP, WG).arrive_and_wait()

    @cute.jit
    def prep_offset_terms(self, sm, kinfo, scale_log2, t):
        """C[tk, r] = sum_d z[d, tk] q[r, d]: two threads per (tk, r), half of the channels each."""
        cfg = self.cfg
        N, D = cfg.N, cfg.D
        x = t // 2
        tk, r = x // N, x % N
        half = t % 2
        acc = Float32(0.0)
        if x < self.q_copies * N:
            for d in cutlass.range(half * (D // 2), (half + 1) * (D // 2), 1, unroll=8):
                acc = acc + sm.sZ[tk * D + d] * sm.sQf[r * D + d]
        # every lane shuffles: shfl.sync names the whole warp, and a warp may hold threads past the terms (q_copies * N
        # of 8: lanes 16-31 of warp 0)
        acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=1)
        if x < self.q_copies * N:
            if half == 0:
                sm.sKinfo[sm_.k_offset_term(kinfo, tk, r)] = acc * scale_log2

    def scores(self, sm, prm, tmem_ptr, t2r, thr_t2r, acc_layout, ss, step, t, wq):
        """S[r] = unscale_t * S[t(l), r] + C[t(l), r]: the ``NM`` columns of this warp's token group."""
        cfg = self.cfg
        N, NM, G = cfg.N, cfg.NM, self.fold.group
        sc = cute.make_rmem_tensor((N,), Float32)
        so = stage(step, cfg.OP_STAGES)
        tk = (wq * 32) // G if G < STEP else 0  # token group of this warp
        acc = load_acc(t2r, thr_t2r, cute.make_tensor(tmem_ptr + ss * cfg.S_COLS + tk * NM, acc_layout), NM)
        cute.arch.fence_view_async_tmem_load()
        unscale = sm.sKinfo[sm_.k_unscale(sm_.kinfo_stage(so), tk)]
        for r in range(N):
            sc[r] = (piece_sum(acc, r, N, cfg.PIECES) * unscale * sm.sQinfo[sm_.s_unscale(r)]
                     + sm.sKinfo[sm_.k_offset_term(sm_.kinfo_stage(so), tk, r)])
        return sc


# ================================================================================================ V
class VHooks(BlackwellFold):
    """V: O^T += V^T . P'^T per step and m-tile. ``accumulators``: PV accumulators per m-tile;
    ``p_stages``: P'^T copies per step (one per scale)."""

    p_stages = 1
    corr_words = 0  # sCorr floats (token-wise V: per-thread offset terms)
    vp_words = 0  # sVp words per P buffer (channel-wise V: the step's (scale, offset) rows)

    def pv_stage(self, mt: int, jl: int) -> int:
        """P'^T stage read by PV accumulator (mt, jl)."""
        return 0

    def pv_kblocks(self, jl: int):
        """(first, end) k-blocks of a step summed by PV accumulator (*, jl)."""
        return 0, self.cfg.KB_S

    def softmax_init(self, sm, t):
        """Softmax warpgroup, before the first step."""

    def softmax_hand_over(self, sm, params, sp, t, nd):
        """Softmax, after P buffer sp is free: what the output warpgroup reads of this step."""

    def softmax_row_done(self, sm, p, r, sp, lane, wq):
        """Softmax, after row r's P of this thread is stored."""

    def softmax_final_row(self, sm, r, t, lane, wq):
        """Softmax, final per-warp reductions of row r (into sRed)."""

    def softmax_final_store(self, sm, r):
        """Softmax, thread r < N: final sums of row r (sRed -> sFinal)."""

    def output_term(self, sm, val, d, r):
        """Output epilogue: channel d of row r plus its offset term (before 1/l)."""
        return val


@register(VTokenWise)
class BlackwellVTokenWise(VHooks):
    """Scale on P: P'_j = P * s[l, j] * 2^-e_j per channel block j (one P stage and one accumulator
    each); offset sum_l z[l, j] P[l], accumulated per softmax thread, added in the epilogue."""

    def __init__(self, fold, cfg):
        super().__init__(fold, cfg)
        self.blocks = fold.channel_blocks
        self.accumulators = max(1, cfg.DM // fold.group)  # channel blocks per m-tile
        self.p_stages = self.blocks
        self.corr_words = self.blocks * cfg.N * WG

    def _block(self, mt: int, jl: int) -> int:
        """Global channel block of local block ``jl`` of m-tile ``mt``."""
        cfg, G = self.cfg, self.fold.group
        return (mt * cfg.DM + jl * min(G, cfg.DM)) // G

    def pv_stage(self, mt: int, jl: int) -> int:
        return self._block(mt, jl)

    def softmax_init(self, sm, t):
        for x in range(self.blocks * self.cfg.N):
            sm.sCorr[x * WG + t] = Float32(0.0)  # per-thread sum_l z[l,j] p[l] (column x = j*N + r)

    @cute.jit
    def softmax_params(self, sm, prm, ring_words, step, ok, red, t, lane, wq, nd: cutlass.Constexpr):
        """(s, z) of the thread's token per channel block j (0 past the end), and the max over the
        step's tokens of |s_j| per warp (the power-of-two normalisation of P*s)."""
        cfg = self.cfg
        vs = cute.make_rmem_tensor((self.blocks,), Float32)
        vz = cute.make_rmem_tensor((self.blocks,), Float32)
        for j in cutlass.range_constexpr(self.blocks):
            s, z = group_params(prm + self.fold.param_element((t % TILE_TOKENS) * self.blocks + j, cfg.V_PARAMS),
                                self.fold)
            vs[j] = fsel(ok, s, Float32(0.0))
            vz[j] = fsel(ok, z, Float32(0.0))
            mv = cute.arch.warp_reduction(fabs(vs[j]), cute.arch.fmax)
            if lane == 0:
                sm.sRed[sm_.red_block(red, j) + wq] = mv
        return vs, vz

    def p_scale(self, sm, red, j):
        return pow2_scale(max4(sm.sRed, sm_.red_block(red, j)))

    def p_operand(self, sm, params, p, alpha, pscale, r, j, t):
        """P'_j of row r (normalised), after adding p * z[l, j] to the running offset term."""
        vs, vz = params
        x = (j * self.cfg.N + r) * WG + t
        sm.sCorr[x] = sm.sCorr[x] * alpha + p * vz[j]
        return p * vs[j] * pscale[j]

    @cute.jit
    def softmax_final_row(self, sm, r, t, lane, wq):
        for j in cutlass.range_constexpr(self.blocks):
            cs = cute.arch.warp_reduction(sm.sCorr[(j * self.cfg.N + r) * WG + t], lambda a, c: a + c)
            if lane == 0:
                sm.sRed[sm_.red_row(sm_.red_block(0, j), r) + wq] = cs

    def softmax_final_store(self, sm, r):
        for j in range(self.blocks):
            o = sm_.red_row(sm_.red_block(0, j), r)
            sm.sFinal[sm_.final_term(j, r)] = sm.sRed[o] + sm.sRed[o + 1] + sm.sRed[o + 2] + sm.sRed[o + 3]

    @cute.jit
    def output_accumulate(self, sm, accO, o_base, mt, d, sp, t2r, thr_t2r, acc_layout, wq):
        """O[mt] = O[mt] * alpha + unscale_j * acc_j: one channel block per warp (groups are >= 32
        channels), its accumulator only."""
        cfg = self.cfg
        N, NM = cfg.N, cfg.NM
        for jl in cutlass.range_constexpr(self.accumulators):
            if (wq * 32) % cfg.DM // min(self.fold.group, cfg.DM) == jl:
                acc = load_acc(t2r, thr_t2r, cute.make_tensor(o_base + (mt * self.accumulators + jl) * NM, acc_layout), NM)
                cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld
                unscale = sm.sAlpha[sm_.p_unscale(sp, self._block(mt, jl))]
                for r in cutlass.range_constexpr(N):
                    accO[mt * N + r] = (accO[mt * N + r] * sm.sAlpha[sm_.alpha(sp, r)]
                                        + piece_sum(acc, r, N, cfg.PIECES) * unscale)

    def output_term(self, sm, val, d, r):
        cv = Float32(0.0)
        for j in range(self.blocks):
            cv = fsel(d // self.fold.group == j, sm.sFinal[sm_.final_term(j, r)], cv)
        return val + cv


@register(VChannelWise)
class BlackwellVChannelWise(VHooks):
    """Scale on the PV accumulator of token group t (one accumulator per group, over its k-blocks);
    offset z[d, t] * Psum[t]. P' = P * 2^7 (P <= 1). The output warpgroup runs a step behind, so
    the softmax copies the step's (scale, offset) rows ring -> registers -> sVp for it."""

    def __init__(self, fold, cfg):
        super().__init__(fold, cfg)
        self.accumulators = self.step_groups  # token groups per step
        self.vp_words = self.step_groups * cfg.D

    def pv_kblocks(self, jl: int):
        KB_S, NT = self.cfg.KB_S, self.step_groups
        return jl * KB_S // NT, (jl + 1) * KB_S // NT

    def softmax_params(self, sm, prm, ring_words, step, ok, red, t, lane, wq, nd):
        """(scale, offset) words of group tv, channel d = (t + 128*i) % D, into registers now (the
        ring stages are released before P buffer sp is free). A scale-only format's word holds its scale in the
        low half, where a pair holds the scale, so sVp keeps one layout."""
        cfg = self.cfg
        D, G = cfg.D, self.fold.group
        vpw = cute.make_rmem_tensor((self.step_groups * nd,), Int32)
        for tv in range(self.step_groups):
            off = tv * min(G, STEP)  # first token of group tv in the step
            grp = (off % TILE_TOKENS) // G if G < TILE_TOKENS else 0  # group within its tile
            vp_ring = ring_words + cute.assume(stage(2 * step + off // TILE_TOKENS, cfg.RING) * cfg.STAGE_WORDS, divby=4)
            for i in range(nd):
                vpw[tv * nd + i] = group_word(vp_ring, cfg.V_PARAMS, grp * D + (t + WG * i) % D, self.fold)
        return vpw

    @cute.jit
    def softmax_hand_over(self, sm, params, sp, t, nd: cutlass.Constexpr):
        D = self.cfg.D
        for tv in cutlass.range_constexpr(self.step_groups):
            for i in cutlass.range_constexpr(nd):
                if t + WG * i < D:  # head_dim 64: threads t and t+64 hold the same word
                    sm.sVp[sp * self.vp_words + tv * D + t + WG * i] = params[tv * nd + i]

    def p_scale(self, sm, red, j):
        return Float32(2.0**FP8_TARGET_EXP)  # P <= 1

    def p_operand(self, sm, params, p, alpha, pscale, r, j, t):
        return p * pscale[j]

    @cute.jit
    def softmax_row_done(self, sm, p, r, sp, lane, wq):
        """Psum per warp (a token group is whole warps)."""
        ps = cute.arch.warp_reduction(p, lambda a, c: a + c)
        if lane == 0:
            sm.sPsum[sm_.psum(sp, wq, r)] = ps

    def output_accumulate(self, sm, accO, o_base, mt, d, sp, t2r, thr_t2r, acc_layout, wq):
        """O[mt] = O[mt] * alpha + sum_t s[d, t] unscale * acc_t + z[d, t] * Psum[t]."""
        cfg = self.cfg
        N, NM, D, G = cfg.N, cfg.NM, cfg.D, self.fold.group
        sVpH = cute.recast_ptr(sm.sVp.iterator, dtype=Float16)
        upd = cute.make_rmem_tensor((N,), Float32)
        for r in range(N):
            upd[r] = Float32(0.0)
        for tv in range(self.step_groups):
            vp, vs = group_scale(sVpH + 2 * (sp * self.vp_words + tv * D + d), self.fold)
            vs, vz = vs * sm.sAlpha[sm_.p_unscale(sp, 0)], group_offset(vp, vs, self.fold)
            acc = load_acc(t2r, thr_t2r, cute.make_tensor(o_base + (mt * self.accumulators + tv) * NM, acc_layout), NM)
            cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld
            w0, w1 = tv * min(G, STEP) // 32, (tv + 1) * min(G, STEP) // 32  # warps of group tv
            for r in range(N):
                ps = Float32(0.0)
                for w in range(w0, w1):
                    ps = ps + sm.sPsum[sm_.psum(sp, w, r)]
                # a group with no visible token adds nothing: its params past the sequence's end are never read as
                # numbers (a caller-built pool may hold inf or NaN there; Hopper zeroes them, VChannelHooks.mask_params)
                upd[r] = upd[r] + fsel(ps != Float32(0.0), vs * piece_sum(acc, r, N, cfg.PIECES) + vz * ps,
                                            Float32(0.0))
        for r in range(N):
            accO[mt * N + r] = accO[mt * N + r] * sm.sAlpha[sm_.alpha(sp, r)] + upd[r]

"""Device hooks of the four fold cases (``foscar.folds``) for the Hopper per-warp ``mma.sync`` kernel.

One class per case, registered against the case class (:func:`hooks_for`); the consumer warp of
``foscar.hopper.kernel`` calls the same hooks for every variant and never branches on the case:

K (``S^T = K . Q^T``, scores in the log2 domain, ``sm_scale*log2(e)`` folded in):
  ``setup(qv)`` loop-invariant state (Q^T B fragments, bias-cancelling accumulators, corrections);
  ``load_params(st, kpar, rows, step, scale_log2)`` the tile's params from shared memory into registers;
  ``scores(st, tp, kfr, tb, nb)`` the 4 accumulator values of token block ``tb``, n8 block ``nb``,
  scale and offset correction applied.
V (``O^T += V^T . P^T``):
  ``setup()``; ``load_params(vpar, rows)``; ``mask_params(tp, rows, valid)`` zero past the sequence end
  (called for a tile that has tokens there); ``pack_p`` the P^T
  B-fragment register of (tb, nb, hr) for P copy ``ps`` (scaled or not) and its correction;
  ``accumulate`` the tile's MMAs into O^T, rescaling O^T by the tile's alpha (every tile; 1 where the running
  max did not move) in the FMA that adds them; ``rescale_direct`` O^T times alpha before a tile that adds its
  P V to O^T itself (a 16-bit window tile, when the running max moved);
  ``output`` an O^T element with the correction the case adds at the end; ``scales_p`` whether the params scale P
  before the MMA (the kernel reads them with the K side, a tile's front) or the PV sums after it (with the V words,
  its back).

Thread coordinates: lane ``4*g + tq``; accumulator rows are tokens ``16*tb + g + 8*hr`` (index
``t = 2*tb + hr`` into ``rows``) for QK and channels ``16*md + g + 8*hr`` for PV; column slot
``cs = e + 2*nb`` (``foscar.hopper.mma``). Scales are folded through the construction: the kernel
multiplies ``s`` by ``fold.scale_factor`` (``1/a = 2^bits``).
"""

from __future__ import annotations

import operator

import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from ..device import fsel, group_params, pack_bf16x2, pack_f16x2, reduce_over_rows, unpack_16x2
from ..folds import HookRegistry, KChannelWise, KTokenWise, VChannelWise, VTokenWise
from ..warp_mma import WarpMma
from .mma import TOKEN_BLOCKS

__all__ = ["hooks_for", "q_index"]

HOOKS = HookRegistry("sm_90a")
register = HOOKS.register
hooks_for = HOOKS.hooks_for  # the Hopper hooks of a plan's fold case for a kernel of config ``cfg``


def q_index(cfg, nb: int, kb: int, hh: int, e: int) -> int:
    """Index in a thread's q values of q[head 8*nb + g, channel 16*kb + 8*hh + 2*tq + e]: the order
    of the Q^T B fragments (value e + 2*hh of n8 block nb, k16 block kb)."""
    return ((nb * cfg.KB_D + kb) * 2 + hh) * 2 + e


class _Hooks:
    def __init__(self, fold, cfg):
        self.fold = fold
        self.cfg = cfg
        self.operand = cfg.k_operand if fold.tensor == "k" else cfg.v_operand
        self.scale = fold.scale_factor  # s' = s / a

    def load_param(self, p_ptr, group):
        """(scale, offset) in fp32 of the tile's ``group``-th group, params at fp16 ``p_ptr``."""
        return group_params(p_ptr + self.fold.param_element(group), self.fold)


class _State:
    """A warp's loop-carried registers of one fold case (attributes set by ``setup``)."""


# ------------------------------------------------------------------------------------------------
# K
# ------------------------------------------------------------------------------------------------
@register(KTokenWise)
class KTokenHooks(_Hooks):
    """One S^T accumulator per channel block j, started at -(bias x Q^T); S = sum_j s'*acc_j + z*Qsum[j]."""

    def setup(self, mma: WarpMma, qv):
        cfg, nj = self.cfg, self.fold.channel_blocks
        st = _State()
        st.qB = [[mma.fragment_B() for _ in range(cfg.KB_D)] for _ in range(mma.NB)]
        st.qsum = cute.make_rmem_tensor((nj * mma.NS,), Float32)  # Qsum[j, column slot]
        st.k_bias = [[mma.zero_accumulator() for _ in range(mma.NB)] for _ in range(nj)]
        for nb in range(mma.NB):
            for kb in range(cfg.KB_D):
                regs = cute.recast_tensor(st.qB[nb][kb], Int32)
                for hh in range(2):
                    regs[hh] = pack_f16x2(qv[q_index(cfg, nb, kb, hh, 0)], qv[q_index(cfg, nb, kb, hh, 1)])
        blocks_per_group = self.fold.group // 16
        for j in range(nj):
            for nb in range(mma.NB):
                self.operand.cancel_bias(mma, st.k_bias[j][nb], st.qB[nb],
                                         range(j * blocks_per_group, (j + 1) * blocks_per_group))
        for j in range(nj):
            for nb in range(mma.NB):
                part = Float32(0.0)
                for kb in range(j * blocks_per_group, (j + 1) * blocks_per_group):
                    for x in range(4):
                        part = part + qv[q_index(cfg, nb, kb, 0, 0) + x]
                part = mma.reduce_over_tq(part)
                for e in range(2):
                    st.qsum[j * mma.NS + 2 * nb + e] = mma.to_columns(part, e)
        return st

    def load_params(self, mma: WarpMma, st, kpar, rows, step, scale_log2):
        nj = self.fold.channel_blocks
        ks = cute.make_rmem_tensor((2 * TOKEN_BLOCKS * nj,), Float32)  # s' * scale_log2
        kz = cute.make_rmem_tensor((2 * TOKEN_BLOCKS * nj,), Float32)  # z * scale_log2
        for t in range(2 * TOKEN_BLOCKS):
            for j in range(nj):
                s, z = self.load_param(kpar, rows[t] * nj + j)
                ks[t * nj + j] = s * (self.scale * scale_log2)
                kz[t * nj + j] = z * scale_log2
        return ks, kz

    def scores(self, mma: WarpMma, st, tp, kfr, tb: int, nb: int):
        ks, kz = tp
        nj, kpg = self.fold.channel_blocks, self.fold.group // 16
        accS = [mma.chain(st.k_bias[j][nb], [(kfr[kb], st.qB[nb][kb]) for kb in range(j * kpg, (j + 1) * kpg)])
                for j in range(nj)]
        out = []
        for i in range(4):
            t = 2 * tb + i // 2
            cs = i % 2 + 2 * nb
            v = Float32(0.0)
            for j in range(nj):
                x = t * nj + j
                v = v + ks[x] * accS[j][i] + kz[x] * st.qsum[j * mma.NS + cs]
            out.append(v)
        return out


@register(KChannelWise)
class KChannelHooks(_Hooks):
    """Q^T scaled by s' per token group (one scaled copy per group of the tile), rebuilt at the first
    tile of each group; S = acc + sum_d z'[d] q[d] (one constant per group; z' = z + centre*s, the codes centred:
    ``KChannelWise.centres_codes``)."""

    def setup(self, mma: WarpMma, qv):
        cfg, ng = self.cfg, self.fold.tile_groups
        st = _State()
        # q in its own 16-bit type (exact: it came from there), two values a register: the loop keeps these, not
        # the 32-bit values, for rebuilding Q^T at each group (16 registers fewer of the state that spills:
        # benchmarks/NOTES.md section 36)
        pairs = mma.NB * cfg.KB_D * 2
        st.q16 = cute.make_rmem_tensor((pairs,), Int32)
        pack = pack_bf16x2 if self.bf16 else pack_f16x2
        for x in range(pairs):
            st.q16[x] = pack(qv[2 * x], qv[2 * x + 1])
        st.qB = [[[mma.fragment_B() for _ in range(cfg.KB_D)] for _ in range(mma.NB)] for _ in range(ng)]
        st.qz = cute.make_rmem_tensor((ng * mma.NS,), Float32)  # sum_d z q per group and column slot
        st.k_bias = [[mma.zero_accumulator() for _ in range(mma.NB)] for _ in range(ng)]
        return st

    @cute.jit
    def load_params(self, mma: WarpMma, st, kpar: cute.Pointer, rows, step: Int32, scale_log2: Float32):
        if step % self.fold.tiles_per_group == 0:  # first tile of a group run: scale Q^T for its group(s)
            self.scale_q(mma, st, kpar, scale_log2)
        return None

    @property
    def bf16(self) -> bool:
        return self.cfg.q_dtype is BFloat16

    def q_pair(self, st, mma: WarpMma, nb: int, kb: int, hh: int):
        """fp32 q at the thread's Q^T positions (e = 0, 1) of (nb, kb, hh)."""
        return unpack_16x2(st.q16[q_index(self.cfg, nb, kb, hh, 0) // 2], self.bf16)

    def scale_q(self, mma: WarpMma, st, kpar, scale_log2):
        """Q^T scaled by s'[d] of each token group of the tile into ``qB[gi]``, the per-group constant
        sum_d z'[d] q[r,d] into ``qz``, and -((bias - b) x scaled Q^T) into ``k_bias[gi]`` (the S^T
        accumulators' initial value: it cancels the operand bias, and centres the codes, against the same rounded
        Qs the data MMAs multiply)."""
        cfg = self.cfg
        for gi in range(self.fold.tile_groups):
            part = [Float32(0.0) for _ in range(mma.NB)]
            for kb in range(cfg.KB_D):
                for hh in range(2):
                    ksp, kz = [], []
                    for e in range(2):
                        s, z = self.load_param(kpar, gi * cfg.D + 16 * kb + 8 * hh + 2 * mma.tq + e)
                        ksp.append(s * (self.scale * scale_log2))
                        kz.append(z)  # z + centre * s: one FFMA, the multiply by scale_log2 moved to the sum
                    for nb in range(mma.NB):
                        q = self.q_pair(st, mma, nb, kb, hh)
                        packed = pack_f16x2(q[0] * ksp[0], q[1] * ksp[1])
                        cute.recast_tensor(st.qB[gi][nb][kb], Int32)[hh] = packed
                        for e in range(2):
                            part[nb] = part[nb] + q[e] * kz[e]
            for nb in range(mma.NB):
                total = mma.reduce_over_tq(part[nb]) * scale_log2
                for e in range(2):
                    st.qz[gi * mma.NS + 2 * nb + e] = mma.to_columns(total, e)
                st.k_bias[gi][nb].fill(0.0)
                self.operand.cancel_bias(mma, st.k_bias[gi][nb], st.qB[gi][nb], range(cfg.KB_D))

    def scores(self, mma: WarpMma, st, tp, kfr, tb: int, nb: int):
        gi = (16 * tb) // self.fold.group if self.fold.tile_groups > 1 else 0
        acc = mma.chain(st.k_bias[gi][nb], [(kfr[kb], st.qB[gi][nb][kb]) for kb in range(self.cfg.KB_D)])
        return [acc[i] + st.qz[gi * mma.NS + i % 2 + 2 * nb] for i in range(4)]


# ------------------------------------------------------------------------------------------------
# V
# ------------------------------------------------------------------------------------------------
def v_fragments(mma: WarpMma, operand, vw, md: int, cfg):
    """A fragments of V^T channel block ``md`` (virtual warp md % 4 of m64 tile md // 4), one per
    k16 token block of the tile."""
    return [operand.a_fragment(mma, vw[md % 4], ((md // 4) * cfg.KB_T + tb) * 4) for tb in range(TOKEN_BLOCKS)]


@register(VTokenWise)
class VTokenHooks(_Hooks):
    """P^T scaled per token by s'[l,j], one copy per channel block j; the offsets add
    sum_l z[l,j] P[l] to every channel of block j. A tile's PV starts at its own -(bias x P^T) and is added
    to O^T by an FP32 add: an accumulator that carried the bias (2^E, then up to 1024x the code weight) over a
    whole split lost its low bits to the MMA's truncating accumulation, an error growing with the split's
    tokens (3x the accuracy rule at 32K tokens per CTA, benchmarks/NOTES.md section 30)."""

    scales_p = True  # its params scale P before the MMA (the pipelined loop's front reads them)

    @property
    def psets(self) -> int:
        return self.fold.channel_blocks

    def setup(self, mma: WarpMma):
        nj = self.fold.channel_blocks
        st = _State()
        st.corr = cute.make_rmem_tensor((nj * mma.NS,), Float32)  # per-thread sum_l z P
        for x in range(nj * mma.NS):
            st.corr[x] = Float32(0.0)
        return st

    def load_params(self, mma: WarpMma, vpar, rows):
        nj = self.fold.channel_blocks
        vs = cute.make_rmem_tensor((2 * TOKEN_BLOCKS * nj,), Float32)  # s' (0 past the end)
        vz = cute.make_rmem_tensor((2 * TOKEN_BLOCKS * nj,), Float32)  # z (0 past the end)
        for t in range(2 * TOKEN_BLOCKS):
            for j in range(nj):
                x = t * nj + j
                s, z = self.load_param(vpar, rows[t] * nj + j)
                vs[x] = s * self.scale
                vz[x] = z
        return vs, vz

    def mask_params(self, mma: WarpMma, tp, rows, valid):
        vs, vz = tp
        nj = self.fold.channel_blocks
        for t in range(2 * TOKEN_BLOCKS):
            for j in range(nj):
                vs[t * nj + j] = fsel_zero(rows[t] < valid, vs[t * nj + j])
                vz[t * nj + j] = fsel_zero(rows[t] < valid, vz[t * nj + j])

    def rescale_corrections(self, mma: WarpMma, st, alpha):
        for x in range(self.fold.channel_blocks * mma.NS):
            st.corr[x] = st.corr[x] * alpha[x % mma.NS]

    def begin_p(self, mma: WarpMma, st):
        return None

    def pack_p(self, mma: WarpMma, st, tp, acc_p, p, tb: int, nb: int, hr: int, ps: int):
        vs, vz = tp
        x = (2 * tb + hr) * self.fold.channel_blocks + ps
        packed = pack_f16x2(p[2 * hr] * vs[x], p[2 * hr + 1] * vs[x])  # Ps = fp16(p*s')
        for e in range(2):
            st.corr[ps * mma.NS + 2 * nb + e] = st.corr[ps * mma.NS + 2 * nb + e] + p[2 * hr + e] * vz[x]
        return packed

    def end_p(self, mma: WarpMma, acc_p):
        return None

    def rescale_direct(self, mma: WarpMma, st, accO, alpha):
        for row in accO:
            for nb in range(mma.NB):
                for i in range(4):
                    row[nb][i] = row[nb][i] * alpha[i % 2 + 2 * nb]

    def accumulate(self, mma: WarpMma, st, tp, acc_p, accO, pB, vw, alpha):
        cfg = self.cfg
        # per channel block and n8 block: the initial value of the tile's PV accumulators
        pv_bias = [[mma.zero_accumulator() for _ in range(mma.NB)] for _ in range(self.fold.channel_blocks)]
        for j in range(self.fold.channel_blocks):
            for nb in range(mma.NB):
                self.operand.cancel_bias(mma, pv_bias[j][nb], [pB[tb][nb][j] for tb in range(TOKEN_BLOCKS)],
                                         range(TOKEN_BLOCKS))
        for md in range(cfg.MB_V):
            vfr = v_fragments(mma, self.operand, vw, md, cfg)
            j = (16 * md) // self.fold.group  # the channel block of these 16 channels
            for nb in range(mma.NB):
                accV = mma.chain(pv_bias[j][nb], [(vfr[tb], pB[tb][nb][j]) for tb in range(TOKEN_BLOCKS)])
                for i in range(4):
                    accO[md][nb][i] = accO[md][nb][i] * alpha[i % 2 + 2 * nb] + accV[i]

    def finish(self, mma: WarpMma, st):
        for x in range(self.fold.channel_blocks * mma.NS):
            st.corr[x] = reduce_over_rows(st.corr[x], operator.add)

    def output(self, mma: WarpMma, st, val, md: int, nb: int, i: int):
        j = (16 * md) // self.fold.group
        return val + st.corr[j * mma.NS + i % 2 + 2 * nb]


@register(VChannelWise)
class VChannelHooks(_Hooks):
    """One PV partial sum per token group of the tile (started at -(bias x P^T)), scaled by s'[d,t]
    after the MMA, plus z[d,t] * Psum[t]; O is rescaled in the same FMA."""

    psets = 1
    scales_p = False  # its params scale the PV partial sums after the MMA (the pipelined loop's back reads them)

    def setup(self, mma: WarpMma):
        return _State()

    def load_params(self, mma: WarpMma, vpar, rows):
        cfg, ng = self.cfg, self.fold.tile_groups
        # channels 16*md + g + 8*hr, per token group of the tile: x = (md*2 + hr)*NG + gi
        cvs = cute.make_rmem_tensor((cfg.MB_V * 2 * ng,), Float32)
        cvz = cute.make_rmem_tensor((cfg.MB_V * 2 * ng,), Float32)
        for gi in range(ng):
            for md in range(cfg.MB_V):
                for hr in range(2):
                    s, z = self.load_param(vpar, gi * cfg.D + 16 * md + mma.g + 8 * hr)
                    x = (md * 2 + hr) * ng + gi
                    cvs[x] = s * self.scale
                    cvz[x] = z
        return cvs, cvz

    def mask_params(self, mma: WarpMma, tp, rows, valid):
        cfg, ng = self.cfg, self.fold.tile_groups
        cvs, cvz = tp
        for gi in range(ng):
            for x in range(gi, cfg.MB_V * 2 * ng, ng):
                cvs[x] = fsel_zero(gi * self.fold.group < valid, cvs[x])
                cvz[x] = fsel_zero(gi * self.fold.group < valid, cvz[x])

    def rescale_corrections(self, mma: WarpMma, st, alpha):
        return None

    def begin_p(self, mma: WarpMma, st):
        """Psum per token group and column slot (of the fp32 p, as the correction takes it)."""
        pg = cute.make_rmem_tensor((self.fold.tile_groups * mma.NS,), Float32)
        for x in range(self.fold.tile_groups * mma.NS):
            pg[x] = Float32(0.0)
        return pg

    def pack_p(self, mma: WarpMma, st, tp, pg, p, tb: int, nb: int, hr: int, ps: int):
        packed = pack_f16x2(p[2 * hr], p[2 * hr + 1])
        gi = (16 * tb) // self.fold.group if self.fold.tile_groups > 1 else 0
        for e in range(2):
            pg[gi * mma.NS + 2 * nb + e] = pg[gi * mma.NS + 2 * nb + e] + p[2 * hr + e]
        return packed

    def end_p(self, mma: WarpMma, pg):
        for x in range(self.fold.tile_groups * mma.NS):
            pg[x] = reduce_over_rows(pg[x], operator.add)  # Psum per token group and column

    def rescale_direct(self, mma: WarpMma, st, accO, alpha):
        for row in accO:
            for nb in range(mma.NB):
                for i in range(4):
                    row[nb][i] = row[nb][i] * alpha[i % 2 + 2 * nb]

    def accumulate(self, mma: WarpMma, st, tp, pg, accO, pB, vw, alpha):
        cfg, ng = self.cfg, self.fold.tile_groups
        cvs, cvz = tp
        tpg = TOKEN_BLOCKS // ng  # token blocks per group of the tile
        # per token group and n8 block: the initial value of every channel block's PV accumulator
        pv_bias = [[mma.zero_accumulator() for _ in range(mma.NB)] for _ in range(ng)]
        for gi in range(ng):
            for nb in range(mma.NB):
                self.operand.cancel_bias(mma, pv_bias[gi][nb], [pB[tb][nb][0] for tb in range(TOKEN_BLOCKS)],
                                         range(gi * tpg, (gi + 1) * tpg))
        for md in range(cfg.MB_V):
            vfr = v_fragments(mma, self.operand, vw, md, cfg)
            for nb in range(mma.NB):
                accV = [mma.chain(pv_bias[gi][nb], [(vfr[tb], pB[tb][nb][0]) for tb in range(gi * tpg, (gi + 1) * tpg)])
                        for gi in range(ng)]
                for i in range(4):
                    cs = i % 2 + 2 * nb
                    add = Float32(0.0)
                    for gi in range(ng):
                        x = (md * 2 + i // 2) * ng + gi
                        add = add + cvs[x] * accV[gi][i] + cvz[x] * pg[gi * mma.NS + cs]
                    accO[md][nb][i] = accO[md][nb][i] * alpha[cs] + add

    def finish(self, mma: WarpMma, st):
        return None

    def output(self, mma: WarpMma, st, val, md: int, nb: int, i: int):
        return val


def fsel_zero(ok, x):
    """``x`` where ``ok``, else 0 (branch-free)."""
    return fsel(ok, x, Float32(0.0))

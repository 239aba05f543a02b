"""The four folding cases, one class each: what is scaled where, which offset correction, the
params geometry the kernels read, and the case's slice of the float64 folded reference.

A code ``c`` of a group with scale ``s`` and offset ``z`` stands for ``x = s*c + z``; the kernels
multiply the construction's operand ``a*c + b`` (``foscar.scheme.Construction``) instead of ``c``, so
they see the folded scale ``s/a`` and offset ``z - s*b/a``. Per query column, token ``l``, channel
``d``, for groups ``j`` (channel blocks) or ``t`` (token blocks):

==================  ===========================================  =====================================
case                scale goes                                   offset becomes
==================  ===========================================  =====================================
K token-wise        on the QK partial sum of channel block j     ``z[l,j] * Qsum[j]``
K channel-wise      on Q, before the MMA (one Q' per block t)    ``sum_d z[d,t] q[d]`` per token block
V token-wise        on P, before the MMA (one P' per block j)    ``sum_l z[l,j] P[l]`` per channel block
V channel-wise      on the PV partial sum of token block t       ``z[d,t] * Psum[t]``
==================  ===========================================  =====================================

A case is registered per (tensor, axis) (:func:`fold_case`); ``Scheme.plan`` builds one instance per
tensor and every consumer reads it: the reference below (:meth:`KFold.scores`,
:meth:`VFold.output`), the params layout both kernels copy (:meth:`FoldCase.params_row`), and the
arch kernels' device hooks (``foscar.hopper.folds``, ``foscar.blackwell.folds``), which are
registered against these classes so that no kernel body branches on the case.

Params layout (per (page, kv_head), ``param_fields`` fp16 values per group: (scale, offset), or the scale of a
scale-only format, whose offset is ``offset_per_scale * scale``): token-wise ``[page_size, D/G]`` (one row per
token, one group per channel block), channel-wise ``[page_size/G, D]`` (one row per token group, one group per
channel). Both are ``rows x per_row`` groups, with ``tokens_per_row`` tokens sharing a row; a 64-token tile reads
``tile_rows`` consecutive rows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

import torch

from .layouts.fragment import TILE_TOKENS

__all__ = [
    "Site",
    "Correction",
    "FoldCase",
    "KFold",
    "VFold",
    "KTokenWise",
    "KChannelWise",
    "VTokenWise",
    "VChannelWise",
    "fold_case",
    "FOLD_CASES",
    "HookRegistry",
]


class Site(str, enum.Enum):
    """Where a group scale is applied."""

    OTHER_OPERAND = "other_operand"  # scales Q (for K) or P (for V) before the MMA
    PARTIAL_SUM = "partial_sum"  # scales the MMA partial sum of one group after the MMA


class Correction(str, enum.Enum):
    """The offset correction each case adds."""

    OFFSET_TIMES_QSUM = "offset_times_qsum"  # K token-wise: sum_j z[l,j] * Qsum[j]
    Q_DOT_OFFSET = "q_dot_offset"  # K channel-wise: sum_d z[d,t] q[d], one per token block
    P_DOT_OFFSET = "p_dot_offset"  # V token-wise: sum_l z[l,j] P[l], one per channel block
    OFFSET_TIMES_PSUM = "offset_times_psum"  # V channel-wise: z[d,t] * Psum[t]


FOLD_CASES: dict[tuple[str, str], type] = {}


def register(cls):
    """Class decorator: the case of ``(cls.tensor, cls.axis)``."""
    FOLD_CASES[(cls.tensor, cls.axis)] = cls
    return cls


def fold_case(tensor: str, quant, head_dim: int, construction) -> "FoldCase":
    """The registered case of ``tensor`` ("k" or "v") quantized as ``quant`` (a TensorQuant), folding
    ``construction``'s operands, centred where the case asks for it (``centres_codes``) and the construction can."""
    cls = FOLD_CASES[(tensor, quant.axis.value)]
    if cls.centres_codes and construction.centre is not None:
        construction = construction.centred()
    ratio = quant.format.offset_per_scale
    return cls(quant.group, quant.bits, head_dim, construction, None if ratio is None else Fraction(ratio))


class HookRegistry:
    """One arch's device hooks of the fold cases: one hook class per case class, registered with
    ``@registry.register(KTokenWise)``; ``registry.hooks_for(plan.k, cfg)`` builds the hooks a kernel
    calls (a subclass of a registered case inherits its hooks)."""

    def __init__(self, arch: str):
        self.arch = arch
        self.classes: dict[type, type] = {}

    def register(self, case: type):
        def add(cls):
            self.classes[case] = cls
            return cls

        return add

    def hooks_for(self, fold: "FoldCase", cfg):
        for case in type(fold).__mro__:
            if case in self.classes:
                return self.classes[case](fold, cfg)
        raise NotImplementedError(f"the {self.arch} kernel has no hooks for the fold case {type(fold).__name__}")


@dataclass(frozen=True)
class FoldCase:
    """One tensor's fold: group size and bits, head_dim, the operand construction ``a*c + b``, and where a group's
    offset comes from: stored next to its scale (``offset_per_scale`` None), or ``offset_per_scale * scale`` of a
    scale-only format (``foscar.formats.Format.offset_per_scale``), whose params hold the scale only."""

    tensor: ClassVar[str] = ""  # "k" | "v"
    axis: ClassVar[str] = ""  # "token" | "channel"
    scale_site: ClassVar[Site]
    correction: ClassVar[Correction]
    centres_codes: ClassVar[bool] = False  # folds codes centred on their midpoint (Construction.centred)

    group: int
    bits: int
    head_dim: int
    construction: object  # foscar.scheme.Construction
    offset_per_scale: Fraction | None = None

    # ---------------------------------------------------------------------------------- geometry
    @property
    def block(self) -> int:
        """Length of the reduction block that shares one scale: a channel block (token-wise) or a
        token block (channel-wise), i.e. the group."""
        return self.group

    @property
    def token_wise(self) -> bool:
        return self.axis == "token"

    @property
    def channel_blocks(self) -> int:
        """Token-wise: (scale, offset) pairs per token (channel blocks of head_dim). Channel-wise: 1."""
        return self.head_dim // self.group if self.token_wise else 1

    @property
    def tile_groups(self) -> int:
        """Channel-wise: token groups a 64-token tile touches (a group of >= 64 tokens counts once).
        Token-wise: 1."""
        return 1 if self.token_wise else max(1, TILE_TOKENS // self.group)

    @property
    def tiles_per_group(self) -> int:
        """Consecutive tiles one channel-wise group spans (1 for token-wise or groups <= 64 tokens)."""
        return 1 if self.token_wise else max(1, self.group // TILE_TOKENS)

    @property
    def tokens_per_row(self) -> int:
        return 1 if self.token_wise else self.group

    @property
    def per_row(self) -> int:
        """(scale, offset) pairs per params row."""
        return self.channel_blocks if self.token_wise else self.head_dim

    @property
    def tile_rows(self) -> int:
        """Params rows a 64-token tile reads."""
        return TILE_TOKENS if self.token_wise else self.tile_groups

    @property
    def param_fields(self) -> int:
        """fp16 values stored per group: 2 (scale, offset) or 1 (the scale of a scale-only format)."""
        return 2 if self.offset_per_scale is None else 1

    @property
    def tile_param_words(self) -> int:
        """int32 words of a tile's params (a word holds one (scale, offset) pair, or two scales)."""
        return self.tile_rows * self.per_row * self.param_fields // 2

    def param_element(self, group, words: int = 0):
        """fp16 element of the first param of the ``group``-th group of params that start ``words`` int32 words into
        an area (host or device ints). Pairs keep the expression the kernels always traced, so their code is
        unchanged."""
        if self.param_fields == 2:
            return 2 * (words + group) if words else group * 2
        return 2 * words + group if words else group

    def offsets(self, scale, offset):
        """The groups' offsets (host tensors): ``offset`` as stored, or ``offset_per_scale * scale``."""
        return offset if self.offset_per_scale is None else scale * float(self.offset_per_scale)

    @property
    def tile_code_words(self) -> int:
        """int32 words of a 64-token tile of packed codes."""
        return TILE_TOKENS * self.head_dim * self.bits // 32

    @property
    def scale_factor(self) -> float:
        """``1/a``: what the kernel multiplies a group scale by (the operand stands for ``a*c + b``)."""
        return float(1 / self.construction.a)

    @property
    def offset_shift(self) -> float:
        """``-b/a``: what the kernel adds, times the group scale, to a group offset (the construction's own offset,
        ``Construction.fold_offset``; non-zero for centred codes)."""
        return float(-self.construction.b / self.construction.a)

    def rows_per_page(self, page_size: int) -> int:
        return page_size // self.tokens_per_row

    def params_row(self, head, slot0, page_size: int):
        """Index of the first group of the tile at ``slot0`` (a multiple of 64) of (page, kv_head) ``head`` (host
        ints or device Int64); its fp16 element is ``param_fields`` times it."""
        row = slot0 if self.tokens_per_row == 1 else slot0 // self.tokens_per_row
        return (head * self.rows_per_page(page_size) + row) * self.per_row

    @property
    def name(self) -> str:
        return f"{self.tensor.upper()} {self.axis}-wise"


# ------------------------------------------------------------------------------------------------
# K: S = q . k. ``scores`` executes the case on one tile in float64 (foscar.reference).
#   qg [b,h,r,d] float64 query; kop [b,h,l,d] operand values; s, z: folded params (per group, as
#   QuantizedKV.codes_and_params gives them), sl: the tile's token slice; rnd: the emulated rounding
#   of the MMA's other operand. Returns scores in natural-log units (times sm_scale).
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KFold(FoldCase):
    tensor = "k"

    def scores(self, qg, kop, s, z, sl, sm_scale: float, log2e: float, rnd):
        raise NotImplementedError


@register
@dataclass(frozen=True)
class KTokenWise(KFold):
    """Scale on the QK partial sum of each channel block j; offset ``z[l,j] * Qsum[j]``."""

    axis = "token"
    scale_site = Site.PARTIAL_SUM
    correction = Correction.OFFSET_TIMES_QSUM

    def scores(self, qg, kop, s, z, sl, sm_scale, log2e, rnd):
        b, h, r, dim = qg.shape
        g = self.block
        q_mma = rnd(qg).reshape(b, h, r, dim // g, g)
        blocks = torch.einsum("bhrjd,bhljd->bhrlj", q_mma, kop.reshape(*kop.shape[:3], dim // g, g))
        scores = torch.einsum("bhrlj,bhlj->bhrl", blocks, s[:, :, sl])
        qsum = qg.reshape(b, h, r, dim // g, g).sum(-1)  # [b,h,r,j]
        return (scores + torch.einsum("bhlj,bhrj->bhrl", z[:, :, sl], qsum)) * sm_scale


@register
@dataclass(frozen=True)
class KChannelWise(KFold):
    """Scale on Q before the MMA (one scaled Q per token block t); offset ``sum_d z[d,t] q[d]``."""

    axis = "channel"
    scale_site = Site.OTHER_OPERAND
    correction = Correction.Q_DOT_OFFSET
    # Q*s' is rounded to the MMA's type once per group t and channel d, and that rounding multiplies the codes of
    # every token of the group: codes of one sign (0..3) make the error common to the group's scores, shifting them
    # together, which the lse and softmax do not average out; codes centred on their midpoint (-1.5..1.5) leave an
    # error of either sign. Emulated (attend_folded, FP16 operands, 30 draws, INT2 / INT4): the lse error from a
    # median 1.8x / 4.4x (at most 4.9x / 11x) a FP16 PyTorch computation's to 0.27x / 0.62x. Its cost: one FFMA per
    # channel per group.
    # V token-wise (P*s' rounded per token) gains less (output error 1.7x smaller) and would pay per tile: 7-24
    # instructions or a spill at the 128-register cap (benchmarks/NOTES.md section 46).
    centres_codes = True

    def scores(self, qg, kop, s, z, sl, sm_scale, log2e, rnd):
        log2_scale = sm_scale * log2e  # the kernels fold the softmax scale into Q*s' (log2 domain)
        tokens = kop.shape[2]
        s_tok = _per_token(s, self.block)[:, :, sl][:, :, :tokens] * log2_scale  # [b,h,l,d]
        z_tok = _per_token(z, self.block)[:, :, sl][:, :, :tokens] * log2_scale
        q_scaled = rnd(qg[:, :, :, None, :] * s_tok[:, :, None])  # [b,h,r,l,d]
        scores = torch.einsum("bhrld,bhld->bhrl", q_scaled, kop)
        corr = (qg[:, :, :, None, :] * z_tok[:, :, None]).sum(-1)
        return (scores + corr) / log2e


# ------------------------------------------------------------------------------------------------
# V: O += P . v. ``output`` executes the case on one tile in float64: p [b,h,r,l] softmax weights,
#   vop [b,h,l,d] operand values; returns (P.v folded, offset correction), both [b,h,r,d].
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VFold(FoldCase):
    tensor = "v"

    def output(self, p, vop, s, z, start: int, tile: int, rnd):
        raise NotImplementedError


@register
@dataclass(frozen=True)
class VTokenWise(VFold):
    """Scale on P before the MMA (one scaled P per channel block j); offset ``sum_l z[l,j] P[l]``."""

    axis = "token"
    scale_site = Site.OTHER_OPERAND
    correction = Correction.P_DOT_OFFSET

    def output(self, p, vop, s, z, start, tile, rnd):
        sl = slice(start, start + tile)
        s_el = s.repeat_interleave(self.block, dim=-1)[:, :, sl]  # [b,h,l,d]
        z_el = z.repeat_interleave(self.block, dim=-1)[:, :, sl]
        p_scaled = rnd(p[..., None] * s_el[:, :, None])  # [b,h,r,l,d]
        pv = torch.einsum("bhrld,bhld->bhrd", p_scaled, vop)
        return pv, (p[..., None] * z_el[:, :, None]).sum(-2)


@register
@dataclass(frozen=True)
class VChannelWise(VFold):
    """Scale on the PV partial sum of token block t; offset ``z[d,t] * Psum[t]``."""

    axis = "channel"
    scale_site = Site.PARTIAL_SUM
    correction = Correction.OFFSET_TIMES_PSUM

    def output(self, p, vop, s, z, start, tile, rnd):
        b, h, r, _ = p.shape
        dim = vop.shape[-1]
        sub = min(self.block, tile)  # a tile holds whole groups, or lies inside one
        blocks = tile // sub
        group_of_block = torch.arange(start, start + tile, sub) // self.block
        p_blocks = rnd(p).reshape(b, h, r, blocks, sub)
        partial = torch.einsum("bhrtl,bhtld->bhrtd", p_blocks, vop.reshape(b, h, blocks, sub, dim))
        pv = torch.einsum("bhrtd,bhtd->bhrd", partial, s[:, :, group_of_block])
        psum = p.reshape(b, h, r, blocks, sub).sum(-1)
        return pv, torch.einsum("bhrt,bhtd->bhrd", psum, z[:, :, group_of_block])


def _per_token(params, group: int):
    """Per-token view ``[b, h, tokens, d]`` of channel-wise params ``[b, h, tokens/group, d]``."""
    return params.repeat_interleave(group, dim=-2)

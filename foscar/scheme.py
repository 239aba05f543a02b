"""The algorithm description: one frozen, hashable object per quantization variant.

A :class:`Scheme` says how K and V are quantized (bits, group axis, group size), the head
geometry and the query dtype. :meth:`Scheme.plan` turns it into a :class:`FoldingPlan`: where each
group scale goes (onto the other MMA operand, or onto the MMA's partial sum) and which offset
correction is added, for one operand construction (how codes become Tensor Core operands, see
``foscar.operands``). Every consumer -- the float64 references, the Hopper and the Blackwell
kernels -- reads the same plan, so a new variant is a new ``Scheme``, never a new kernel.

Dequantized value of a code ``c`` in a group with scale ``s`` and offset ``z``: ``x = s*c + z``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from fractions import Fraction

import torch

__all__ = [
    "Axis",
    "TensorQuant",
    "Scheme",
    "Construction",
    "Site",
    "Correction",
    "OperandFold",
    "FoldingPlan",
    "HOPPER_FP16",
    "BLACKWELL_FP4",
    "BLACKWELL_FP8",
    "construction_for",
    "GROUP_SIZES",
    "HEAD_DIMS",
    "BITS",
]

BITS = (2, 4)
HEAD_DIMS = (64, 128, 256)
GROUP_SIZES = (32, 64, 128)  # plus head_dim itself
Q_DTYPES = (torch.bfloat16, torch.float16)
PARAM_DTYPE = torch.float16  # scale and offset storage: 4 bytes per group, as in the byte arithmetic
MAX_GQA_RATIO = 64


class Axis(str, enum.Enum):
    """Which elements share one (scale, offset).

    TOKEN: one token and a block of ``group`` consecutive channels.
    CHANNEL: one channel and a block of ``group`` consecutive tokens.
    """

    TOKEN = "token"
    CHANNEL = "channel"


@dataclass(frozen=True)
class TensorQuant:
    """Grouping of one of K or V."""

    axis: Axis
    group: int

    def __post_init__(self):
        object.__setattr__(self, "axis", Axis(self.axis))


class Site(str, enum.Enum):
    """Where a group scale is applied."""

    OTHER_OPERAND = "other_operand"  # scales Q (for K) or P (for V) before the MMA
    PARTIAL_SUM = "partial_sum"  # scales the MMA partial sum of one group after the MMA


class Correction(str, enum.Enum):
    """The offset correction each case adds (design.md, the four folding cases)."""

    OFFSET_TIMES_QSUM = "offset_times_qsum"  # K token-wise: sum_j z[l,j] * Qsum[j]
    Q_DOT_OFFSET = "q_dot_offset"  # K channel-wise: sum_d z[d,t] q[d], one per token block
    P_DOT_OFFSET = "p_dot_offset"  # V token-wise: sum_l z[l,j] P[l], one per channel block
    OFFSET_TIMES_PSUM = "offset_times_psum"  # V channel-wise: z[d,t] * Psum[t]


@dataclass(frozen=True)
class Construction:
    """How an arch turns a code into an MMA operand value: ``operand = a*c + b``, exactly.

    The kernel multiplies with ``operand`` instead of ``c``, so the effective scale becomes
    ``s/a`` and the offset absorbs the bias: ``x = (s/a)*operand + (z - s*b/a)``.
    """

    name: str
    operand_dtype: str
    a: Fraction
    b: Fraction

    def fold_scale(self, scale):
        return scale / float(self.a)

    def fold_offset(self, scale, offset):
        return offset - scale * float(self.b / self.a)

    def operand(self, codes):
        """Operand values of integer ``codes`` (any torch tensor), in float64."""
        return codes.to(torch.float64) * float(self.a) + float(self.b)


# Hopper: codes ORed into FP16 mantissas -> bias + c/2^bits, with a per-slot power-of-two bias that
# the kernel removes inside the accumulator (one MMA against a constant fragment, foscar.operands):
# the folding sees c/2^bits.
HOPPER_FP16 = {bits: Construction(f"fp16-c/{2**bits}", "float16", Fraction(1, 2**bits), Fraction(0)) for bits in BITS}
# Blackwell: an INT2 code zero-extended into an FP4 E2M1 nibble is c/2; an INT4 code zero-extended
# into a byte is the E4M3 encoding of c * 2^-9 (subnormals 0..7, then the first binade: one mask, no table).
BLACKWELL_FP4 = Construction("fp4e2m1-c/2", "float4_e2m1fn", Fraction(1, 2), Fraction(0))
BLACKWELL_FP8 = Construction("fp8e4m3-c/512", "float8_e4m3fn", Fraction(1, 512), Fraction(0))


def construction_for(arch: str, bits: int) -> Construction:
    """The operand construction each arch's kernel uses."""
    if arch == "sm_90a":
        return HOPPER_FP16[bits]
    if arch == "sm_100a":
        return BLACKWELL_FP4 if bits == 2 else BLACKWELL_FP8
    raise ValueError(f"arch must be 'sm_90a' or 'sm_100a', got {arch!r}")


@dataclass(frozen=True)
class OperandFold:
    """The plan for one of K or V."""

    axis: Axis
    group: int
    scale_site: Site
    correction: Correction
    # Length of the MMA reduction block whose partial sum needs its own accumulator (PARTIAL_SUM),
    # or of the block sharing one scaled copy of the other operand (OTHER_OPERAND).
    block: int


@dataclass(frozen=True)
class FoldingPlan:
    scheme: "Scheme"
    construction: Construction
    k: OperandFold
    v: OperandFold


@dataclass(frozen=True)
class Scheme:
    """A quantization variant of the KV cache.

    ``bits``: 2 or 4. ``k``/``v``: group axis and size (32, 64, 128 or head_dim; token-wise groups
    must divide head_dim). ``head_dim``: 64, 128 or 256. ``gqa_ratio``: query heads per KV head.
    ``q_dtype``: bfloat16 or float16 (the cache quantizes K/V of the same dtype).
    """

    bits: int
    k: TensorQuant
    v: TensorQuant
    head_dim: int = 128
    gqa_ratio: int = 1
    q_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if isinstance(self.bits, bool) or self.bits not in BITS:
            raise ValueError(f"Scheme.bits must be one of {BITS}, got {self.bits!r}")
        if isinstance(self.head_dim, bool) or self.head_dim not in HEAD_DIMS:
            raise ValueError(f"Scheme.head_dim must be one of {HEAD_DIMS}, got {self.head_dim!r}")
        if not isinstance(self.gqa_ratio, int) or isinstance(self.gqa_ratio, bool) or not 1 <= self.gqa_ratio <= MAX_GQA_RATIO:
            raise ValueError(f"Scheme.gqa_ratio must be an int in 1..{MAX_GQA_RATIO}, got {self.gqa_ratio!r}")
        if self.q_dtype not in Q_DTYPES:
            raise ValueError(f"Scheme.q_dtype must be torch.bfloat16 or torch.float16, got {self.q_dtype!r}")
        for name in ("k", "v"):
            quant = getattr(self, name)
            if isinstance(quant, tuple) and not isinstance(quant, TensorQuant):
                quant = TensorQuant(*quant)
                object.__setattr__(self, name, quant)
            if not isinstance(quant, TensorQuant):
                raise ValueError(f"Scheme.{name} must be a TensorQuant(axis, group), got {quant!r}")
            allowed = sorted(set(GROUP_SIZES) | {self.head_dim})
            if isinstance(quant.group, bool) or quant.group not in allowed:
                raise ValueError(f"Scheme.{name}.group must be one of {allowed} for head_dim {self.head_dim}, got {quant.group!r}")
            if quant.axis is Axis.TOKEN and self.head_dim % quant.group:
                raise ValueError(
                    f"Scheme.{name}.group={quant.group} must divide head_dim={self.head_dim} for token-wise groups"
                )

    @classmethod
    def make(cls, bits, k="token", k_group=None, v="token", v_group=None, head_dim=128, gqa_ratio=1, q_dtype=torch.bfloat16):
        """Shorthand: ``Scheme.make(2, k="channel", k_group=128)``; groups default to head_dim."""
        if isinstance(head_dim, bool) or head_dim not in HEAD_DIMS:
            raise ValueError(f"Scheme.head_dim must be one of {HEAD_DIMS}, got {head_dim!r}")
        for name, axis in (("k", k), ("v", v)):
            if axis not in ("token", "channel", Axis.TOKEN, Axis.CHANNEL):
                raise ValueError(f"Scheme.{name} axis must be 'token' or 'channel', got {axis!r}")
        return cls(
            bits,
            TensorQuant(Axis(k), head_dim if k_group is None else k_group),
            TensorQuant(Axis(v), head_dim if v_group is None else v_group),
            head_dim,
            gqa_ratio,
            q_dtype,
        )

    @property
    def levels(self) -> int:
        return 2**self.bits

    @property
    def name(self) -> str:
        return (
            f"int{self.bits}-k{self.k.axis.value[0]}{self.k.group}-v{self.v.axis.value[0]}{self.v.group}"
            f"-d{self.head_dim}-gqa{self.gqa_ratio}-{str(self.q_dtype).removeprefix('torch.')}"
        )

    def plan(self, construction: Construction | None = None) -> FoldingPlan:
        """Where every scale and offset goes, for ``construction`` (default: Hopper FP16)."""
        construction = construction or HOPPER_FP16[self.bits]
        if self.k.axis is Axis.TOKEN:
            k = OperandFold(Axis.TOKEN, self.k.group, Site.PARTIAL_SUM, Correction.OFFSET_TIMES_QSUM, self.k.group)
        else:
            k = OperandFold(Axis.CHANNEL, self.k.group, Site.OTHER_OPERAND, Correction.Q_DOT_OFFSET, self.k.group)
        if self.v.axis is Axis.TOKEN:
            v = OperandFold(Axis.TOKEN, self.v.group, Site.OTHER_OPERAND, Correction.P_DOT_OFFSET, self.v.group)
        else:
            v = OperandFold(Axis.CHANNEL, self.v.group, Site.PARTIAL_SUM, Correction.OFFSET_TIMES_PSUM, self.v.group)
        return FoldingPlan(self, construction, k, v)

    def bytes_per_element(self) -> float:
        """Bytes read per cached K or V element: codes plus the fp16 (scale, offset) share."""
        return self.bits / 8 + (4 / self.k.group + 4 / self.v.group) / 2

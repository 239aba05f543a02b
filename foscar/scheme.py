"""The algorithm description: one frozen, hashable object per quantization variant.

A :class:`Scheme` says how K and V are quantized, each on its own (bits, group axis, group size),
the head geometry and the query dtype. :meth:`Scheme.plan` turns it into a :class:`FoldingPlan`: where each
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

from .folds import Correction, FoldCase, Site, fold_case

__all__ = [
    "Axis",
    "TensorQuant",
    "Scheme",
    "Construction",
    "Site",
    "Correction",
    "FoldingPlan",
    "HOPPER_FP16",
    "BLACKWELL_FP4",
    "BLACKWELL_FP8",
    "construction_for",
    "CONSTRUCTIONS",
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


def _check_int(field: str, value, allowed) -> int:
    """``value`` as an int from ``allowed``, or a ValueError naming ``field`` (2.0 and True are refused:
    they would pass ``in`` and fail later, far from their cause)."""
    if type(value) is not int or value not in allowed:
        raise ValueError(f"{field} must be one of {sorted(allowed)} (an int), got {value!r}")
    return value


@dataclass(frozen=True)
class TensorQuant:
    """Quantization of one of K or V: group axis, group size and code bit width."""

    axis: Axis
    group: int
    bits: int

    def __post_init__(self):
        object.__setattr__(self, "axis", Axis(self.axis))

    @property
    def levels(self) -> int:
        return 2**self.bits


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


# the construction each arch's kernel uses per code width (foscar.archs.Arch.construction reads it)
CONSTRUCTIONS = {
    ("sm_90a", 2): HOPPER_FP16[2],
    ("sm_90a", 4): HOPPER_FP16[4],
    ("sm_100a", 2): BLACKWELL_FP4,
    ("sm_100a", 4): BLACKWELL_FP8,
}


def construction_for(arch: str, bits: int) -> Construction:
    """The operand construction ``arch``'s kernel uses for ``bits``-bit codes."""
    if (arch, bits) not in CONSTRUCTIONS:
        raise ValueError(f"arch must be one of {sorted({a for a, _ in CONSTRUCTIONS})} and bits one of {BITS}, "
                         f"got arch={arch!r}, bits={bits!r}")
    return CONSTRUCTIONS[(arch, bits)]


@dataclass(frozen=True)
class FoldingPlan:
    """What every consumer of a variant reads: per tensor its fold case (``foscar.folds``: where the
    scale goes, which correction, the params geometry) with the arch's operand construction."""

    scheme: "Scheme"
    arch: str
    k: FoldCase
    v: FoldCase

    @property
    def construction(self) -> Construction:
        """The construction K and V share (an INT4/INT2 mix has one per tensor: ``k.construction``)."""
        if self.k.construction != self.v.construction:
            raise ValueError(f"K and V use different constructions in {self.scheme.name}: read plan.k / plan.v")
        return self.k.construction


@dataclass(frozen=True)
class Scheme:
    """A quantization variant of the KV cache.

    ``k``/``v``: group axis, group size (32, 64, 128 or head_dim; token-wise groups must divide
    head_dim) and bits (2 or 4), each tensor on its own. ``head_dim``: 64, 128 or 256.
    ``gqa_ratio``: query heads per KV head (which ratios a kernel builds is the arch's
    ``can_implement``, ``foscar.archs``). ``q_dtype``: bfloat16 or float16 (the cache quantizes
    K/V of the same dtype).
    """

    k: TensorQuant
    v: TensorQuant
    head_dim: int = 128
    gqa_ratio: int = 1
    q_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        _check_int("Scheme.head_dim", self.head_dim, HEAD_DIMS)
        if type(self.gqa_ratio) is not int or not 1 <= self.gqa_ratio <= MAX_GQA_RATIO:
            raise ValueError(f"Scheme.gqa_ratio must be an int in 1..{MAX_GQA_RATIO}, got {self.gqa_ratio!r}")
        if self.q_dtype not in Q_DTYPES:
            raise ValueError(f"Scheme.q_dtype must be torch.bfloat16 or torch.float16, got {self.q_dtype!r}")
        for name in ("k", "v"):
            quant = getattr(self, name)
            if isinstance(quant, tuple) and not isinstance(quant, TensorQuant):
                quant = TensorQuant(*quant)
                object.__setattr__(self, name, quant)
            if not isinstance(quant, TensorQuant):
                raise ValueError(f"Scheme.{name} must be a TensorQuant(axis, group, bits), got {quant!r}")
            _check_int(f"Scheme.{name}.bits", quant.bits, BITS)
            _check_int(f"Scheme.{name}.group", quant.group, set(GROUP_SIZES) | {self.head_dim})
            if quant.axis is Axis.TOKEN and self.head_dim % quant.group:
                raise ValueError(
                    f"Scheme.{name}.group={quant.group} must divide head_dim={self.head_dim} for token-wise groups"
                )

    @classmethod
    def make(cls, bits=None, k="token", k_group=None, v="token", v_group=None, head_dim=128, gqa_ratio=1,
             q_dtype=torch.bfloat16, *, k_bits=None, v_bits=None):
        """Shorthand: ``Scheme.make(2, k="channel", k_group=128)``; groups default to head_dim.

        ``bits`` sets both tensors; ``k_bits`` / ``v_bits`` set one each (keys are the more
        sensitive tensor: ``Scheme.make(k_bits=4, v_bits=2)``)."""
        _check_int("Scheme.head_dim", head_dim, HEAD_DIMS)
        for name, axis in (("k", k), ("v", v)):
            if axis not in ("token", "channel", Axis.TOKEN, Axis.CHANNEL):
                raise ValueError(f"Scheme.{name} axis must be 'token' or 'channel', got {axis!r}")
        if bits is None and (k_bits is None or v_bits is None):
            raise ValueError("Scheme.bits: give bits (both tensors) or both k_bits and v_bits")
        for name, value in (("bits", bits), ("k.bits", k_bits), ("v.bits", v_bits)):
            if value is not None:
                _check_int(f"Scheme.{name}", value, BITS)
        k_bits = bits if k_bits is None else k_bits
        v_bits = bits if v_bits is None else v_bits
        return cls(
            TensorQuant(Axis(k), head_dim if k_group is None else k_group, k_bits),
            TensorQuant(Axis(v), head_dim if v_group is None else v_group, v_bits),
            head_dim,
            gqa_ratio,
            q_dtype,
        )

    @property
    def bits(self) -> int:
        """The common bit width of K and V; a mixed scheme has none (read ``k.bits`` / ``v.bits``)."""
        if self.k.bits != self.v.bits:
            raise ValueError(f"Scheme {self.name} has {self.k.bits}-bit K and {self.v.bits}-bit V codes: "
                             "read scheme.k.bits / scheme.v.bits")
        return self.k.bits

    @property
    def name(self) -> str:
        bits = f"int{self.k.bits}" if self.k.bits == self.v.bits else f"k{self.k.bits}v{self.v.bits}"
        return (
            f"{bits}-k{self.k.axis.value[0]}{self.k.group}-v{self.v.axis.value[0]}{self.v.group}"
            f"-d{self.head_dim}-gqa{self.gqa_ratio}-{str(self.q_dtype).removeprefix('torch.')}"
        )

    def plan(self, arch: str = "sm_90a", *, construction: Construction | None = None) -> FoldingPlan:
        """Where every scale and offset goes, with the operand construction of ``arch`` per tensor
        (``construction`` overrides it for both, e.g. to test the algebra with a biased one)."""
        cases = [
            fold_case(name, quant, self.head_dim, construction or construction_for(arch, quant.bits))
            for name, quant in (("k", self.k), ("v", self.v))
        ]
        return FoldingPlan(self, arch, *cases)

    def bytes_per_element(self) -> float:
        """Bytes read per cached K or V element: codes plus the fp16 (scale, offset) share."""
        return (self.k.bits + self.v.bits) / 16 + (4 / self.k.group + 4 / self.v.group) / 2

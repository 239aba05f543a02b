"""The algorithm description: one frozen, hashable object per quantization variant.

A :class:`Scheme` says how K and V are quantized, each on its own (code format, group axis, group size),
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

import torch

from .folds import Correction, FoldCase, Site, fold_case
from .formats import (BLACKWELL_FP4, BLACKWELL_FP8, PACKABLE_BITS, PARAM_DTYPE, Construction, Format, Unsupported,
                      as_format, hopper_fp16)

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
    "GROUP_SIZES",
    "HEAD_DIMS",
    "PARAM_DTYPE",
]

HEAD_DIMS = (64, 128, 256)
GROUP_SIZES = (32, 64, 128)  # plus head_dim itself
Q_DTYPES = (torch.bfloat16, torch.float16)
MAX_GQA_RATIO = 64
HOPPER_FP16 = {bits: hopper_fp16(bits) for bits in PACKABLE_BITS}


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
    """Quantization of one of K or V: group axis, group size and code format (``foscar.formats``; a bit
    width names the registered ``int<bits>`` format: ``TensorQuant("token", 128, 2)``)."""

    axis: Axis
    group: int
    format: Format

    def __post_init__(self):
        object.__setattr__(self, "axis", Axis(self.axis))
        object.__setattr__(self, "format", as_format(self.format, "TensorQuant.format"))

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def levels(self) -> int:
        return self.format.levels

    def params_shape(self, tokens: int, dim: int) -> tuple[int, int]:
        """Rows x groups of the params of ``tokens`` x ``dim`` values (:func:`params_shape`); each group stores
        ``param_fields`` fp16 values, the params tensors' last dim."""
        return params_shape(self.axis, self.group, tokens, dim)

    @property
    def param_fields(self) -> int:
        """fp16 params per group: 2 (scale, offset) or 1 (scale; ``Format.param_fields``)."""
        return self.format.param_fields

    def grouped(self, x):
        """View ``x [..., L, D]`` as ``[..., groups_l, gl, groups_d, gd]`` (one group = gl x gd)."""
        *lead, length, dim = x.shape
        if self.axis is Axis.TOKEN:
            return x.reshape(*lead, length, 1, dim // self.group, self.group)
        return x.reshape(*lead, length // self.group, self.group, dim, 1)


def params_shape(axis: Axis, group: int, tokens, dim):
    """Rows x pairs of the (scale, offset) params of ``tokens`` x ``dim`` values grouped along ``axis``: one row per
    token and a pair per channel block (token-wise), or one row per token group and a pair per channel
    (channel-wise). The one source of the params geometry (quantize, append, dequantize, cache pools, decode
    validation; the fold cases' ``params_row`` addresses the same); ``tokens`` may be a kernel's Int32."""
    return (tokens, dim // group) if axis is Axis.TOKEN else (tokens // group, dim)


def construction_for(arch: str, fmt) -> Construction:
    """The operand construction ``arch``'s kernel uses for ``fmt`` (a Format, a registered name or a bit
    width); a ValueError with the one-line reason where it has none."""
    return as_format(fmt).construction(arch)


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
        """The construction K and V share. An INT4/INT2 mix has one per tensor, and so has Hopper's K channel-wise
        fold (its codes centred: ``KChannelWise.centres_codes``): read ``k.construction`` / ``v.construction``."""
        if self.k.construction != self.v.construction:
            raise ValueError(f"K and V use different constructions in {self.scheme.name}: read plan.k / plan.v")
        return self.k.construction


@dataclass(frozen=True)
class Scheme:
    """A quantization variant of the KV cache.

    ``k``/``v``: group axis, group size (32, 64, 128 or head_dim; token-wise groups must divide
    head_dim) and code format (``foscar.formats``: INT2, INT4 or any registered one), each tensor on
    its own. ``head_dim``: 64, 128 or 256.
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
                raise ValueError(f"Scheme.{name} must be a TensorQuant(axis, group, format), got {quant!r}")
            _check_int(f"Scheme.{name}.group", quant.group, set(GROUP_SIZES) | {self.head_dim})
            if quant.axis is Axis.TOKEN and self.head_dim % quant.group:
                raise ValueError(
                    f"Scheme.{name}.group={quant.group} must divide head_dim={self.head_dim} for token-wise groups"
                )

    @classmethod
    def make(cls, bits=None, k="token", k_group=None, v="token", v_group=None, head_dim=128, gqa_ratio=1,
             q_dtype=torch.bfloat16, *, k_bits=None, v_bits=None, format=None, k_format=None, v_format=None):
        """Shorthand: ``Scheme.make(2, k="channel", k_group=128)``; groups default to head_dim.

        ``bits`` (a bit width of a registered ``int<bits>`` format) or ``format`` (a Format or a
        registered name, ``foscar.formats``) sets both tensors; ``k_bits`` / ``v_bits`` or
        ``k_format`` / ``v_format`` set one each (keys are the more sensitive tensor:
        ``Scheme.make(k_bits=4, v_bits=2)``)."""
        _check_int("Scheme.head_dim", head_dim, HEAD_DIMS)
        for name, axis in (("k", k), ("v", v)):
            if axis not in ("token", "channel", Axis.TOKEN, Axis.CHANNEL):
                raise ValueError(f"Scheme.{name} axis must be 'token' or 'channel', got {axis!r}")
        given = {"bits": bits, "format": format, "k.bits": k_bits, "v.bits": v_bits, "k.format": k_format,
                 "v.format": v_format}
        formats = {name: as_format(value, f"Scheme.{name}") for name, value in given.items() if value is not None}
        if "bits" in formats and "format" in formats:
            raise ValueError("Scheme.format: give bits or format, not both")
        both = formats.get("bits", formats.get("format"))
        per_tensor = {}
        for t in ("k", "v"):
            if f"{t}.bits" in formats and f"{t}.format" in formats:
                raise ValueError(f"Scheme.{t}.format: give {t}_bits or {t}_format, not both")
            per_tensor[t] = formats.get(f"{t}.bits", formats.get(f"{t}.format", both))
        if per_tensor["k"] is None or per_tensor["v"] is None:
            raise ValueError("Scheme.bits: give bits or format (both tensors), or one of k_bits / k_format and one of "
                             "v_bits / v_format")
        return cls(
            TensorQuant(Axis(k), head_dim if k_group is None else k_group, per_tensor["k"]),
            TensorQuant(Axis(v), head_dim if v_group is None else v_group, per_tensor["v"]),
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
    def q_dtype_name(self) -> str:
        """``q_dtype`` as the kernels' configs name it: "bfloat16" or "float16"."""
        return str(self.q_dtype).removeprefix("torch.")

    @property
    def name(self) -> str:
        kf, vf = self.k.format, self.v.format
        bits = kf.name if kf == vf else f"k{kf.name.removeprefix('int')}v{vf.name.removeprefix('int')}"
        return (
            f"{bits}-k{self.k.axis.value[0]}{self.k.group}-v{self.v.axis.value[0]}{self.v.group}"
            f"-d{self.head_dim}-gqa{self.gqa_ratio}-{self.q_dtype_name}"
        )

    def plan(self, arch: str = "sm_90a", *, construction: Construction | None = None) -> FoldingPlan:
        """Where every scale and offset goes, with the operand construction of ``arch`` per tensor
        (``construction`` overrides it for both, e.g. to test the algebra with a biased one); a
        ValueError naming the tensor where ``arch`` has no construction for its format."""
        cases = []
        for name, quant in (("k", self.k), ("v", self.v)):
            try:
                con = construction or quant.format.construction(arch)
            except Unsupported as err:
                raise Unsupported(f"Scheme.{name}.format: {err}") from None
            cases.append(fold_case(name, quant, self.head_dim, con))
        return FoldingPlan(self, arch, *cases)

    def bytes_per_element(self) -> float:
        """Bytes read per cached K or V element: codes plus the fp16 params' share."""
        params = 2 * self.k.param_fields / self.k.group + 2 * self.v.param_fields / self.v.group
        return (self.k.bits + self.v.bits) / 16 + params / 2

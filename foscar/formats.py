"""Code formats: one object per way of storing one tensor's values as codes plus group params.

A :class:`Format` owns everything about one tensor's codes that does not depend on where its groups
lie (the group axis and size are the fold case's, ``foscar.folds``):

* its bit width (``bits``: codes per 32-bit word, the packed tile sizes of ``foscar.layouts``);
* the host quantizer and dequantizer of a group (:meth:`Format.quantize`, :meth:`Format.dequantize`),
  which the cache's append kernel reproduces on the device and the float64 references read back;
* its operand construction per arch (:meth:`Format.construction`): how that arch's kernel turns a
  code into an MMA operand value ``a*c + b``, or an :class:`Unsupported` reason, which
  ``foscar.archs.Arch.can_implement`` reports before anything compiles.

What the kernels implement bounds what a format may say: each arch's decode kernel builds one construction per
width (:func:`kernel_construction`), and every kernel (decode, dequantize, append) computes ``scale * code +
offset``, the offset stored next to the scale (``param_fields = 2``) or, for a scale-only format (``param_fields =
1``: half the params bytes), its fixed multiple ``offset_per_scale * scale`` (symmetric INT4: ``-8 * scale``),
derived in registers. The append kernel quantizes by the format's :class:`AppendRule`. A format that names another
construction, dequantizes otherwise (:func:`affine_mismatch`) or whose rule differs from its host quantizer
(:func:`append_mismatch`) is refused before compiling, with the reason; its host path (quantize, references) still
runs.

A format is registered under its name (:func:`register_format`); ``Scheme.make(format=...)``,
``k_format=`` / ``v_format=`` take a registered name or any instance, and every consumer (quantize,
append, dequantize, cache pools, decode validation, the references and both arch kernels) reads the
format through the scheme's plan, never a bit-width literal. A new format is a subclass written
anywhere (``notebooks/04_*``, ``tests/user_formats.py`` write INT8 outside the package)::

    class Int8(MinMaxFormat):
        name, bits = "int8", 8

    register_format(Int8())

Formats are frozen and hashable, equal where their class and instance attributes are: the compile key of a kernel
holds its scheme, and with it the formats (:meth:`Format.compile_key` adds every declaration a kernel reads and the
source of a format class written outside the package, so editing it never reuses a stale kernel).
"""

from __future__ import annotations

import abc
import functools
import hashlib
import inspect
from dataclasses import dataclass, field
from fractions import Fraction
from typing import ClassVar

import torch

__all__ = ["Format", "MinMaxFormat", "Int2", "Int4", "INT2", "INT4", "Unsupported", "Construction", "AppendRule",
           "FORMATS", "register_format", "as_format", "int_widths", "hopper_fp16", "BLACKWELL_FP4",
           "BLACKWELL_FP8", "PARAM_DTYPE", "PACKABLE_BITS", "kernel_construction", "affine_mismatch",
           "append_mismatch"]


PARAM_DTYPE = torch.float16  # scale and offset storage: 4 bytes per group, as in the byte arithmetic
from .targets import BLACKWELL as BLACKWELL_ARCH
from .targets import HOPPER as HOPPER_ARCH
# widths whose codes the packed tile layouts hold (a 32-bit word holds whole codes of both FP16 halves)
PACKABLE_BITS = (2, 4, 8)


class Unsupported(ValueError):
    """An arch cannot build a format's operands: the message is the one-line reason."""


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
    # a code the kernel can subtract from every operand for free (None: it cannot); what the kernel can do, not what
    # the construction is, so not compared: a format that names the operands equals the kernel's construction
    centre: Fraction | None = field(default=None, compare=False)

    def centred(self) -> "Construction":
        """This construction with the codes centred on :attr:`centre`: ``operand = a*(c - centre) + b``. A fold
        case with ``centres_codes`` takes it (``foscar.folds.fold_case``)."""
        if self.centre is None:
            raise ValueError(f"the construction {self.name} cannot centre its codes (centre None)")
        return Construction(f"{self.name}-centred", self.operand_dtype, self.a, self.b - self.a * self.centre)

    def fold_scale(self, scale):
        return scale / float(self.a)

    def fold_offset(self, scale, offset):
        return offset - scale * float(self.b / self.a)

    def operand(self, codes):
        """Operand values of integer ``codes`` (any torch tensor), in float64."""
        return codes.to(torch.float64) * float(self.a) + float(self.b)


@functools.cache
def hopper_fp16(bits: int) -> Construction:
    """Hopper: codes ORed into FP16 mantissas -> bias + c/2^bits, with a per-slot power-of-two bias that
    the kernel removes inside the accumulator (one MMA against a constant fragment, ``foscar.operands``):
    the folding sees ``c/2^bits``. Exact for codes of up to 8 bits (the 10-bit mantissa holds them).

    The same MMA subtracts any constant at no cost, so the codes can be centred (:meth:`Construction.centred`) on
    their midpoint: the constant ``-(bias + centre/2^bits)`` stays an exact FP16 for every slot bias (at most 16,
    where the FP16 ulp is 2^-6; an 8-bit midpoint 127.5 is not, so 8-bit codes centre on 128)."""
    centre = Fraction(2**bits - 1, 2)
    if (centre / 2**bits * 64).denominator != 1:
        centre = Fraction(2 ** (bits - 1))
    return Construction(f"fp16-c/{2**bits}", "float16", Fraction(1, 2**bits), Fraction(0), centre)


# Blackwell: an INT2 code zero-extended into an FP4 E2M1 nibble is c/2; an INT4 code zero-extended into a
# byte is the E4M3 encoding of c * 2^-9 (subnormals 0..7, then the first binade: one mask, no table).
BLACKWELL_FP4 = Construction("fp4e2m1-c/2", "float4_e2m1fn", Fraction(1, 2), Fraction(0))
BLACKWELL_FP8 = Construction("fp8e4m3-c/512", "float8_e4m3fn", Fraction(1, 512), Fraction(0))
BLACKWELL_UNSIGNED = {2: BLACKWELL_FP4, 4: BLACKWELL_FP8}


def kernel_construction(arch: str, bits: int) -> Construction | None:
    """The construction ``arch``'s decode kernel builds from ``bits``-bit codes (None: it builds none). The kernels
    implement exactly this one per width: a format whose :meth:`Format.construction` names another is refused
    before compiling (``foscar.launch.KernelSet.can_implement``), never folded with the wrong ``a`` and ``b``."""
    if arch == HOPPER_ARCH:
        return hopper_fp16(bits)
    if arch == BLACKWELL_ARCH:
        return BLACKWELL_UNSIGNED.get(bits)
    return None


@functools.cache
def affine_mismatch(fmt: "Format") -> str | None:
    """Where ``fmt`` is not what every kernel computes (the decode folds, the dequantize and append kernels):
    ``scale * code + offset`` per group, the offset stored next to the scale or, for a scale-only format, the fixed
    multiple ``offset_per_scale * scale``. A one-line reason (a code where ``fmt.dequantize`` differs); None where
    they agree on every code (float64 probe with a few scales and offsets, relative tolerance 1e-6)."""
    # grouped shapes [a, gl, b, gd] (Format.quantize's): a = one code per row, b = four groups; params exact in fp16
    codes = torch.arange(fmt.levels, dtype=torch.float64)[:, None, None, None].expand(-1, 1, 4, 1)
    scale = torch.tensor([0.0, 0.5, -1.25, 2.0**-9], dtype=torch.float64)[None, None, :, None]
    if fmt.param_fields == 2:
        offset = stored = torch.tensor([1.0, -2.5, 0.75, 0.0], dtype=torch.float64)[None, None, :, None]
    else:
        offset, stored = scale * float(fmt.offset_per_scale), None
    want = codes * scale + offset
    try:
        got = torch.as_tensor(fmt.dequantize(codes, scale, stored), dtype=torch.float64)
    except Exception as err:  # noqa: BLE001 - any failure of user code is the reason
        return f"{fmt.name}.dequantize(codes, scale, offset) raised {type(err).__name__}: {err}"
    bad = ~torch.isclose(got.expand_as(want), want, rtol=1e-6, atol=1e-9) if got.shape in (want.shape, ()) else None
    if bad is None:
        return f"{fmt.name}.dequantize returned shape {tuple(got.shape)} for codes/scale/offset broadcasting to " \
               f"{tuple(want.shape)}"
    if bad.any():
        c, _, g, _ = (int(i) for i in bad.nonzero()[0])
        return (f"the kernels dequantize scale * code + offset, {fmt.name}.dequantize does not (code {c}, scale "
                f"{float(scale[0, 0, g, 0])}, offset {float(offset[0, 0, g, 0])}: "
                f"{float(got.expand_as(want)[c, 0, g, 0])}, kernels {float(want[c, 0, g, 0])})")
    return None


@dataclass(frozen=True)
class AppendRule:
    """How the cache's append kernel (``foscar.kernels.quantize``) quantizes a whole group on the device, step by
    step in float32 as a host quantizer does (:meth:`emulate` runs the same steps in torch; :func:`append_mismatch`
    holds them against the format's own ``quantize``):

    * ``range``: ``"minmax"`` (``lo, hi`` = the group's min and max) or ``"absmax"`` (``lo = 0``, ``hi`` = max |x|);
    * ``scale = fp16((hi - lo) / steps)`` (IEEE float32 division); ``offset = fp16(lo)`` where the format stores one;
    * ``code = clamp(roundeven((x - offset) / scale) + shift, 0, 2^bits - 1)`` with the stored fp16 values widened
      to float32 (no subtraction for a scale-only format); a group with ``scale == 0`` has codes 0."""

    range: str
    steps: int
    shift: int = 0

    RANGES: ClassVar[tuple[str, ...]] = ("minmax", "absmax")

    def __post_init__(self):
        if self.range not in self.RANGES:
            raise ValueError(f"AppendRule.range must be one of {self.RANGES}, got {self.range!r}")
        if type(self.steps) is not int or self.steps < 1:
            raise ValueError(f"AppendRule.steps must be a positive int, got {self.steps!r}")
        if type(self.shift) is not int:
            raise ValueError(f"AppendRule.shift must be an int, got {self.shift!r}")

    def emulate(self, grouped: torch.Tensor, bits: int, param_fields: int):
        """``(codes, scale, offset)`` of float32 ``grouped [..., a, gl, b, gd]`` (every element valid, as in the
        kernel), in the kernel's steps; offset None where ``param_fields`` is 1."""
        if self.range == "minmax":
            lo, hi = grouped.amin(dim=(-3, -1), keepdim=True), grouped.amax(dim=(-3, -1), keepdim=True)
        else:
            hi = grouped.abs().amax(dim=(-3, -1), keepdim=True)
            lo = torch.zeros_like(hi)
        scale = ((hi - lo) / torch.full_like(hi, self.steps)).to(PARAM_DTYPE)
        offset = lo.to(PARAM_DTYPE) if param_fields == 2 else None
        s32 = scale.to(torch.float32)
        x = grouped if offset is None else grouped - offset.to(torch.float32)
        codes = (torch.round(x / torch.where(s32 == 0, 1.0, s32)) + self.shift).clamp_(0, 2**bits - 1)
        return torch.where(s32 != 0, codes, 0.0), scale, offset


@functools.cache
def append_mismatch(fmt: Format) -> str | None:
    """Where the append kernel cannot reproduce ``fmt.quantize``: the format declares no :class:`AppendRule`, or
    the rule's steps (:meth:`AppendRule.emulate`) give other codes or params than ``fmt.quantize`` on a probe of
    whole groups (random, one-signed, constant, one outlier). A one-line reason, or None (bit-exact)."""
    rule = fmt.append_rule
    if rule is None:
        return (f"{fmt.name} declares no append_rule (foscar.formats.AppendRule): the append kernel quantizes on the "
                "device by that rule")
    gen = torch.Generator().manual_seed(0)
    grouped = torch.randn(6, 16, 4, 8, generator=gen) * torch.tensor([1e-3, 3.0, 1.0, 40.0])[:, None]  # tiny, ...
    grouped[:, :, 1] = grouped[:, :, 1].abs() + 0.5  # one-signed groups
    grouped[:, :, 2] = 0.25  # constant groups
    grouped[3, 5, 3, 2] = -700.0  # an outlier
    want = rule.emulate(grouped, fmt.bits, fmt.param_fields)
    try:
        got = fmt.quantize(grouped, torch.ones_like(grouped, dtype=torch.bool), "probe")
    except Exception as err:  # noqa: BLE001 - any failure of user code is the reason
        return f"{fmt.name}.quantize raised {type(err).__name__} on the append rule's probe: {err}"
    for name, a, b in zip(("codes", "scale", "offset"), got, want):
        same = (a is None) == (b is None) and (b is None or (a.shape == b.shape and torch.equal(a.float(), b.float())))
        if not same:
            return (f"the append kernel quantizes by {rule} and gets other {name} than {fmt.name}.quantize on a "
                    "probe: the rule must repeat the host quantizer's float32 steps")
    return None


class Format(abc.ABC):
    """One tensor's code format (module docstring). Subclasses set ``name`` and ``bits`` and implement
    every abstract method; a class that sets ``name`` but leaves a method abstract is refused when it
    is defined, not inside a compile."""

    name: ClassVar[str] = ""
    bits: ClassVar[int] = 0
    # fp16 params stored per group: 2 = (scale, offset); 1 = the scale only (``quantize`` returns offset None and
    # ``dequantize`` receives None: half the params bytes)
    param_fields: ClassVar[int] = 2
    # a scale-only format's offset as a fixed multiple of its scale (symmetric INT4: Fraction(-8)), exactly where
    # param_fields is 1: the kernels derive ``offset = offset_per_scale * scale`` from the one stored field
    offset_per_scale: ClassVar[Fraction | None] = None
    # how the cache's append kernel quantizes a group on the device (None: the append kernel refuses the format)
    append_rule: ClassVar[AppendRule | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            return  # an abstract family (MinMaxFormat); its concrete formats name themselves
        # (ABCMeta sets __abstractmethods__ only after this hook: read the methods themselves)
        missing = sorted(n for n in dir(cls) if getattr(getattr(cls, n, None), "__isabstractmethod__", False))
        if missing:
            raise TypeError(f"format {cls.__name__} ({cls.name!r}) leaves {missing} abstract: a format defines "
                            "them all")
        if type(cls.bits) is not int or cls.bits not in PACKABLE_BITS:
            raise TypeError(f"format {cls.__name__}: bits must be one of {PACKABLE_BITS} (codes per packed word), "
                            f"got {cls.bits!r}")
        if cls.param_fields not in (1, 2):
            raise TypeError(f"format {cls.__name__}: param_fields must be 1 (scale) or 2 (scale, offset), got "
                            f"{cls.param_fields!r}")
        ratio = cls.offset_per_scale
        if (ratio is None) != (cls.param_fields == 2) or isinstance(ratio, bool) or not isinstance(
                ratio, (type(None), int, Fraction)):
            raise TypeError(f"format {cls.__name__}: offset_per_scale (the offset as a fixed multiple of the scale, "
                            f"an int or Fraction) is required exactly where param_fields is 1; got {ratio!r} with "
                            f"param_fields={cls.param_fields}")
        if not isinstance(getattr(cls, "append_rule", None), (type(None), AppendRule, property)):
            raise TypeError(f"format {cls.__name__}: append_rule must be a foscar.formats.AppendRule or None, got "
                            f"{cls.append_rule!r}")
        if not isinstance(cls.name, str) or not cls.name.replace("-", "").replace("_", "").isalnum():
            raise TypeError(f"format {cls.__name__}: name must be a short identifier, got {cls.name!r}")

    @property
    def levels(self) -> int:
        return 2**self.bits

    # ------------------------------------------------------------------ host
    @abc.abstractmethod
    def quantize(self, grouped: torch.Tensor, mask: torch.Tensor, name: str):
        """``(codes, scale, offset)`` of float32 ``grouped [..., a, gl, b, gd]`` (one group = gl x gd
        elements, ``mask`` the valid ones): codes float32 integers of ``grouped``'s shape (0 where
        invalid), scale and offset fp16 ``[..., a, 1, b, 1]`` (offset None where ``param_fields`` is 1).
        ``name`` ("k", "v") for errors."""

    @abc.abstractmethod
    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """The values ``codes`` stand for, given their groups' ``scale`` and ``offset`` (broadcast; None where
        ``param_fields`` is 1)."""

    # ------------------------------------------------------------------ per arch
    @abc.abstractmethod
    def construction(self, arch: str) -> Construction:
        """How ``arch``'s kernel turns this format's codes into MMA operands; raises :class:`Unsupported`
        with a one-line reason where it cannot."""

    def compile_key(self) -> tuple:
        """What a compiled kernel depends on: the format's repr (its instance attributes too), every declaration a
        kernel reads (bits, params, offset multiple, append rule, each arch's construction), so that two formats of
        one source (a factory's classes, a class whose source cannot be read: ``python -c``, a notebook cell) never
        share a kernel, plus a hash of its class's source where it is written outside the package (the package's
        own sources are in every key)."""
        constructions = []
        for arch in (HOPPER_ARCH, BLACKWELL_ARCH):
            try:
                constructions.append(repr(self.construction(arch)))
            except Unsupported as err:
                constructions.append(f"unsupported: {err}")
        extra = ()
        for cls in type(self).__mro__:
            module = getattr(cls, "__module__", "")
            if cls is object or module.startswith("foscar.") or module == "abc":
                continue
            try:
                extra += (hashlib.sha256(inspect.getsource(cls).encode()).hexdigest()[:16],)
            except (OSError, TypeError):
                extra += (cls.__qualname__,)
        declared = (self.name, self.bits, self.param_fields, repr(self.offset_per_scale), repr(self.append_rule))
        return (repr(self), declared, tuple(constructions)) + extra

    def _state(self) -> tuple:
        """The instance's own attributes (a format's parameters, ``MyFormat(clip=0.5)``), sorted by name."""
        return tuple(sorted(vars(self).items()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._state())})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self._state() == other._state()

    def __hash__(self) -> int:
        return hash((type(self).__module__, type(self).__qualname__, repr(self._state())))  # (any attribute types)


class MinMaxFormat(Format):
    """Asymmetric min-max integer codes, one (scale, offset) per group:

    * ``offset = fp16(min)`` and ``scale = fp16((max - min) / (2^bits - 1))`` over the group's valid
      elements (round to nearest even, in float32);
    * ``code = clamp(round_half_even((x - offset) / scale), 0, 2^bits - 1)`` in float32, using the
      *stored* fp16 scale and offset, so ``scale*code + offset`` is the nearest point of the grid the
      kernel actually sees. A constant group has ``scale = 0`` and codes 0.

    The cache's append kernel (``foscar.kernels.quantize``) rounds the same way for any ``bits``
    (:attr:`append_rule`). Operands: Hopper ORs the codes into FP16 mantissas (any packable width); Blackwell's tcgen05
    ``kind::f8f6f4`` MMA holds 2-bit (FP4) and 4-bit (FP8 E4M3) codes exactly."""

    def quantize(self, grouped, mask, name):
        levels = self.levels - 1
        lo = torch.where(mask, grouped, torch.inf).amin(dim=(-3, -1), keepdim=True)
        hi = torch.where(mask, grouped, -torch.inf).amax(dim=(-3, -1), keepdim=True)
        empty = ~torch.isfinite(lo)
        lo, hi = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
        offset = lo.to(PARAM_DTYPE)
        # a tensor divisor: CUDA turns division by a Python scalar into a multiply by its reciprocal,
        # which can differ from the correctly rounded quotient (and from the quantize kernel) by 1 ulp
        scale = ((hi - lo) / torch.full_like(hi, levels)).to(PARAM_DTYPE)
        if not (torch.isfinite(offset).all() and torch.isfinite(scale).all()):
            raise ValueError(f"{name} exceeds the float16 range of the group scale/offset")
        s32, z32 = scale.to(torch.float32), offset.to(torch.float32)
        codes = torch.round((grouped - z32) / torch.where(s32 == 0, 1.0, s32)).clamp_(0, levels)
        return torch.where(mask & (s32 != 0), codes, 0.0), scale, offset

    def dequantize(self, codes, scale, offset):
        return codes * scale + offset

    @property
    def append_rule(self) -> AppendRule:
        return AppendRule("minmax", self.levels - 1)

    def construction(self, arch):
        built = kernel_construction(arch, self.bits)
        if built is not None:
            return built
        if arch == BLACKWELL_ARCH:
            raise Unsupported(f"{self.name}: the sm_100a kernel's tcgen05 kind::f8f6f4 MMA holds codes of at "
                              f"most 4 bits exactly (FP4 E2M1, FP8 E4M3), not {self.bits}-bit codes")
        raise Unsupported(f"{self.name}: no operand construction for arch {arch!r}")


class Int2(MinMaxFormat):
    """INT2, asymmetric min-max (KIVI, OSCAR)."""

    name, bits = "int2", 2


class Int4(MinMaxFormat):
    """INT4, asymmetric min-max."""

    name, bits = "int4", 4


INT2, INT4 = Int2(), Int4()
FORMATS: dict[str, Format] = {}


def register_format(fmt: Format) -> Format:
    """Make ``fmt`` known by its name (``Scheme.make(format="int8")``, the CLI, the test matrix);
    re-registering an equal format (its class and attributes) is a no-op that returns the registered one, another
    format under a taken name a ValueError."""
    if not isinstance(fmt, Format):
        raise TypeError(f"format must be a foscar.formats.Format instance, got {type(fmt).__name__}")
    held = FORMATS.get(fmt.name)
    if held is not None:
        if held != fmt:
            raise ValueError(f"format name {fmt.name!r} is taken by {held!r}")
        return held
    FORMATS[fmt.name] = fmt
    return fmt


def int_widths() -> list[int]:
    """The bit widths that name a registered ``int<bits>`` format (``as_format(2)``): the CLI's choices."""
    return sorted(int(n[3:]) for n in FORMATS if n.startswith("int") and n[3:].isdigit())


def as_format(value, field: str = "format") -> Format:
    """A Format from an instance, a registered name, or a bit width of a registered ``int<bits>``
    format (``2``, ``4``); a ValueError naming ``field`` otherwise (2.0 and True are refused)."""
    if isinstance(value, Format):
        return value
    if isinstance(value, str) and value in FORMATS:
        return FORMATS[value]
    if type(value) is int and f"int{value}" in FORMATS:
        return FORMATS[f"int{value}"]
    raise ValueError(f"{field} must be a Format, one of {sorted(FORMATS)} or a bit width in {int_widths()}, "
                     f"got {value!r}")


for _fmt in (INT2, INT4):
    register_format(_fmt)

"""Code formats written outside the package, the way a user writes one (``foscar.formats``): registered
on import (``tests/conftest.py`` imports this module), they join the registry-driven GPU coverage matrix
(``foscar.testing.coverage_matrix``) and ``python -m benchmarks.decode --user-formats tests/user_formats.py``.
"""

import torch

from foscar.formats import (
    PARAM_DTYPE,
    AppendRule,
    Format,
    MinMaxFormat,
    Unsupported,
    kernel_construction,
    register_format,
)


class Int8(MinMaxFormat):
    """INT8, asymmetric min-max per group: the 8-bit KV cache serving engines offer. Hopper ORs each code
    into an FP16 mantissa like the 2- and 4-bit ones; Blackwell's FP4/FP8 MMA operands cannot hold 256
    levels exactly, so its ``can_implement`` refuses it (``MinMaxFormat.construction``)."""

    name, bits = "int8", 8


INT8 = register_format(Int8())


class SymInt4(Format):
    """Symmetric INT4, scale only: ``scale = fp16(absmax / 7)`` per group, ``code = clamp(round(x / scale) + 8, 0,
    15)``, ``x = scale * (code - 8)``: one fp16 per group, half the params bytes of min-max INT4. Still affine, its
    offset a fixed multiple of its scale (``offset_per_scale``), so both arches' kernels take it: they derive the
    offset in registers; the append kernel quantizes by ``append_rule``, this quantizer's float32 steps."""

    name, bits, param_fields = "sym-int4", 4, 1
    offset_per_scale = -8
    append_rule = AppendRule("absmax", steps=7, shift=8)

    def quantize(self, grouped, mask, name):
        absmax = torch.where(mask, grouped.abs(), 0.0).amax(dim=(-3, -1), keepdim=True)
        scale = (absmax / torch.full_like(absmax, 7)).to(PARAM_DTYPE)
        if not torch.isfinite(scale).all():
            raise ValueError(f"{name} exceeds the float16 range of the group scale")
        s32 = scale.to(torch.float32)
        codes = (torch.round(grouped / torch.where(s32 == 0, 1.0, s32)) + 8).clamp_(0, 15)
        return torch.where(mask & (s32 != 0), codes, 0.0), scale, None

    def dequantize(self, codes, scale, offset):
        return (codes - 8) * scale

    def construction(self, arch):
        built = kernel_construction(arch, self.bits)  # the unsigned codes the kernels build, as min-max INT4's
        if built is None:
            raise Unsupported(f"{self.name}: no operand construction for arch {arch!r}")
        return built


SYM_INT4 = register_format(SymInt4())

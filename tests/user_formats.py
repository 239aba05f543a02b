"""Code formats written outside the package, the way a user writes one (``foscar.formats``): registered
on import (``tests/conftest.py`` imports this module), they join the registry-driven GPU coverage matrix
(``foscar.testing.coverage_matrix``) and ``python -m benchmarks.decode --user-formats tests/user_formats.py``.
"""

from foscar.formats import MinMaxFormat, register_format


class Int8(MinMaxFormat):
    """INT8, asymmetric min-max per group: the 8-bit KV cache serving engines offer. Hopper ORs each code
    into an FP16 mantissa like the 2- and 4-bit ones; Blackwell's FP4/FP8 MMA operands cannot hold 256
    levels exactly, so its ``can_implement`` refuses it (``MinMaxFormat.construction``)."""

    name, bits = "int8", 8


INT8 = register_format(Int8())

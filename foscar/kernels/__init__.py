"""Standalone CuTe DSL kernels shared by both arches: cache dequantization and the split-KV combine
(the quantize-on-append kernel is ``foscar.kernels.quantize``)."""

from .combine import Combine, combine_splits, compile_combine
from .dequantize import Dequantize, DequantizeConfig, PagesDequantizer, compile_dequantize, dequantize_pages

__all__ = [
    "Combine",
    "combine_splits",
    "compile_combine",
    "Dequantize",
    "DequantizeConfig",
    "compile_dequantize",
    "dequantize_pages",
    "PagesDequantizer",
]

"""Standalone CuTe DSL kernels shared by both arches: cache dequantization and split-KV combine."""

from .combine import Combine, combine_splits, compile_combine
from .dequantize import Dequantize, DequantizeConfig, compile_dequantize, dequantize_pages

__all__ = [
    "Combine",
    "combine_splits",
    "compile_combine",
    "Dequantize",
    "DequantizeConfig",
    "compile_dequantize",
    "dequantize_pages",
]

"""Standalone CuTe DSL kernels shared by both arches: cache dequantization, split-KV combine, and
the BF16 sink/window attention fused with that combine."""

from .combine import Combine, combine_splits, compile_combine
from .dequantize import Dequantize, DequantizeConfig, compile_dequantize, dequantize_pages
from .window import WindowMerge, compile_window_merge, window_merge

__all__ = [
    "Combine",
    "combine_splits",
    "compile_combine",
    "Dequantize",
    "DequantizeConfig",
    "compile_dequantize",
    "dequantize_pages",
    "WindowMerge",
    "compile_window_merge",
    "window_merge",
]

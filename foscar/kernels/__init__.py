"""Standalone CuTe DSL kernels shared by both arches: cache dequantization, the split-KV combine and the merge of a
chunk's partial attentions (the quantize-on-append kernel is ``foscar.kernels.quantize``)."""

from .combine import Combine, combine_splits, compile_combine
from .dequantize import Dequantize, DequantizeConfig, PagesDequantizer, compile_dequantize, dequantize_pages
from .merge_parts import MergeParts, compile_merge_parts

__all__ = [
    "Combine",
    "combine_splits",
    "compile_combine",
    "Dequantize",
    "DequantizeConfig",
    "compile_dequantize",
    "dequantize_pages",
    "PagesDequantizer",
    "MergeParts",
    "compile_merge_parts",
]

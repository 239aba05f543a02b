"""FOSCAR: decode attention over 2- and 4-bit KV caches through affine folding.

A variant is a :class:`Scheme`; ``quantize_kv`` builds a paged cache for it; the references in
``foscar.reference`` define what every kernel computes. ``foscar.cache.PagedKVCache`` serves many sequences;
:class:`BatchAttention` attends a mixed batch over it (``docs/engines.md``).
"""

from .batch import BatchAttention  # a mixed batch (decode, verify, extend) over a PagedKVCache: plan / run
from .decode import compile_decode  # the decode functions stay in foscar.decode (no name shadowing);
# the module is callable: foscar.decode(q, cache) is foscar.decode.decode(q, cache)
from .quantize import PAGE_SIZES, QuantizedKV, dequantize_groups, quantize_groups, quantize_kv
from .scheme import Axis, Construction, FoldingPlan, Scheme, TensorQuant

__all__ = [
    "Axis",
    "BatchAttention",
    "Construction",
    "compile_decode",
    "FoldingPlan",
    "PAGE_SIZES",
    "QuantizedKV",
    "Scheme",
    "TensorQuant",
    "dequantize_groups",
    "quantize_groups",
    "quantize_kv",
]
__version__ = "0.1.0"

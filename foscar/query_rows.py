"""The query rows of one KV head that a decode CTA attends, and where they live in q and out.

A decode kernel's query tile holds ``R = gqa x tokens`` columns per KV head: column ``c`` is query token
``c // gqa`` (of the ``tokens`` new tokens of its sequence) of query head ``c % gqa`` of the KV head. The
query and output tensors are ``[batch, tokens, kv_heads * gqa, head_dim]`` (``lse`` without the last dim),
so the columns of one KV head are ``gqa`` consecutive rows per token, ``kv_heads * gqa`` rows apart. With
one token (single-token decode) they are ``R`` consecutive rows, the layout ``[batch, kv_heads * gqa,
head_dim]`` the kernels read and write.

Several tokens (speculative verification: the draft tokens, already appended) attend causally
(:meth:`QueryRows.sees`). In the cache decode the draft sits in the 16-bit window, so the packed pages are
fully visible and only the window carries the mask; in ``decode_paged`` every token is packed, and the
kernel's packed tiles carry it (:meth:`QueryRows.row_bound`).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from .device import output_offsets

__all__ = ["QueryRows", "MAX_QUERY_COLUMNS", "KvHead", "Output", "launches"]

MAX_QUERY_COLUMNS = 16  # gqa x tokens columns a query tile holds (two n8 MMA blocks)


class QueryRows:
    """Compile time: ``gqa`` query heads per KV head, ``tokens`` query tokens per sequence."""

    def __init__(self, gqa: int, tokens: int = 1):
        if not 1 <= gqa * tokens <= MAX_QUERY_COLUMNS:
            raise ValueError(f"{tokens} query tokens x gqa_ratio={gqa} = {gqa * tokens} query rows per KV head: "
                             f"a decode tile holds 1..{MAX_QUERY_COLUMNS}")
        self.gqa, self.tokens = gqa, tokens
        self.R = gqa * tokens

    def first(self, b, h, kv_heads) -> Int64:
        """Row (of ``[batch * tokens * kv_heads * gqa]``) of column 0 of sequence ``b``'s KV head ``h``."""
        if cutlass.const_expr(self.tokens == 1):
            return (b * kv_heads + h).to(Int64) * self.R
        return (b * (self.tokens * kv_heads) + h).to(Int64) * self.gqa

    def offset(self, col, kv_heads):
        """Rows from column 0's to column ``col``'s."""
        if cutlass.const_expr(self.tokens == 1):
            return col
        return col % self.gqa + col // self.gqa * (kv_heads * self.gqa)

    def row(self, b, h, col, kv_heads) -> Int64:
        """Row of column ``col`` of sequence ``b``'s KV head ``h``."""
        if cutlass.const_expr(self.tokens == 1):
            return (b * (kv_heads * self.R) + h * self.R + col).to(Int64)
        return self.first(b, h, kv_heads) + self.offset(col, kv_heads)

    def sees(self, col, position, n: Int32):
        """Whether column ``col`` attends the token at ``position`` of its ``n``-token sequence, whose last
        ``tokens`` tokens are the query tokens (causal)."""
        return position <= n - self.tokens + col // self.gqa

    def row_bound(self, col, valid):
        """The causal mask within a tile whose first ``valid`` rows precede the sequence's end: column ``col``
        attends rows ``< row_bound`` (:meth:`sees` shifted to the tile; a padding column past ``R``, ``valid``)."""
        return valid - cutlass.max(self.tokens - 1 - col // self.gqa, 0)


def launches(tokens: int, step: int):
    """``(first, last, later)`` of each launch of ``step`` query tokens that ``tokens`` (the sequences' last ones) are
    cut into, in order: tokens ``first..last-1`` attend the sequences as they were before their ``later`` last
    tokens (``lengths - later``), the same causal view a single launch gives them."""
    return [(first, min(first + step, tokens), tokens - min(first + step, tokens)) for first in range(0, tokens, step)]


# Frozen dataclasses, like ``foscar.pipeline``'s bundles: a kernel may call their methods inside runtime loops
# and branches (docs/design.md section 3).
@dataclass(frozen=True)
class KvHead:
    """The (sequence, KV head) a CTA attends: batch entry ``b`` (its rows of q and out), KV head ``h`` of
    ``kv_heads``; ``row``: the sequence's page-table row where the kernel reads it so (Hopper: ``b`` in the
    decode, the cache row in the cache decode)."""

    b: Int32
    h: Int32
    kv_heads: Int32
    row: Int32 | None = None


@dataclass(frozen=True)
class Output:
    """Where a CTA's attention result goes: ``o`` and ``lse``, the final output (``o [B, Hq, D]`` q dtype,
    ``lse [B, Hq]``, by query row) or, when ``partial``, fp32 partial ``index`` of ``count`` per query row
    (``[B, Hq, count, D]``, ``[B, Hq, count]``); with ``item``, work item ``item``'s partial, held item-major
    (``[items, R, D]``, ``[items, R]``: ``foscar.work_list``)."""

    o: cute.Pointer
    lse: cute.Pointer
    partial: bool
    index: Int32
    count: Int32
    item: Int32 | None = None

    def offsets(self, rows: QueryRows, head: KvHead, col, head_dim: int):
        """(first ``o`` element, ``lse`` element) of query column ``col`` of ``head``."""
        if self.item is not None:
            lidx = self.item.to(Int64) * rows.R + col
            return lidx * head_dim, lidx
        return output_offsets(self.partial, rows.row(head.b, head.h, col, head.kv_heads), self.index, self.count,
                              head_dim)

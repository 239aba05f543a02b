"""Attention of a chunk of new tokens over a long cached prefix (chunked prefill, a prefix-cache hit, a new turn),
block by block, for ``PagedKVCache.attend_chunk`` on a kernel cache.

The cached tokens come as blocks of K/V in the query's dtype (the cache dequantizes one block of packed pages at a
time, at most ``foscar.cache.BLOCK_BYTES`` of K and V: ``foscar.cache.block_pages``); each block is fully visible to every query token and is attended by
a fused attention that keeps its scores on chip and returns each row's log-sum-exp (:func:`fused_attention`: cuDNN's
or FlashAttention-2 through torch on a GPU, the CPU's flash kernel on the CPU). The chunk's own tokens follow, causal.

cuDNN is about twice as fast where a block's attention is compute-bound, but torch plans it once per shape, ~36 ms
on the H200 (``benchmarks/fused_attention.py``, ``benchmarks/NOTES.md`` section 25), and a chunk over a growing
prefix would meet a new shape at every call. So cuDNN only takes shapes from a bounded set, each planned once per
process (:func:`_cudnn_rows`): blocks of a multiple of ``CUDNN_TOKENS`` keys (the cache's full blocks) with the
query rows padded to one of four sizes per octave; the rest (a sequence's last block, its 16-bit slots, the
chunk's own tokens; every block of a model whose ``BLOCK_BYTES`` hold fewer than ``CUDNN_TOKENS`` tokens, e.g. 32
KV heads of head_dim 256) takes FlashAttention-2, which plans nothing.

The partial outputs merge by their LSE in FP32: given a ``merge`` (a kernel cache passes
``foscar.kernels.merge_parts``), in one launch that reads each partial once and writes the chunk's output layout
(:class:`MergedParts`), else by torch ops (:class:`Merged`, the CPU's). Extra memory: one block, the partials held
for a merge (``HELD_PART_BYTES``; ``HELD_BYTES`` on the CPU), the chunk's query and outputs, never the whole prefix.

Shapes: a query head ``h`` of KV head ``h // gqa``; for the cached blocks, which every token sees, the ``gqa``
heads of a KV head fold into the rows of one attention (``[kv_heads, gqa * L, D]``, row ``g * L + t``), so the
block's K/V are read once per KV head. A chunk too short to fill the GPU with its rows splits a block into
``pieces``, strided views of it given to one attention as a batch.

The blocks are the dequantize-then-attend algebra with a bounded working set, not a folded kernel: the values of a
block are written once and read back. They round the dequantized values, and each block's output, to the query's
dtype, as a BF16 (FP16) PyTorch computation on the same cache rounds its values and P.

A short chunk skips the blocks: on Hopper (at most ``PREFILL_COLUMNS`` query columns per KV head) the packed pages
go to the prefill kernel (:class:`PackedPrefill`, ``foscar.hopper.prefill``: the query rows 128 to a CTA, each
packed tile dequantized once per CTA in shared memory), elsewhere (at most ``DECODE_COLUMNS``) to the folded decode
kernel with the chunk's tokens as more query heads (:class:`PackedPrefix`), which reads them once per tile of 16
columns; neither writes them in 16 bits in global memory, and the fused attention then takes only the 16-bit slots
and the chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Merged", "MergedParts", "PackedPrefill", "PackedPrefix", "chunk_attention", "fused_attention"]

CUDNN_HEAD_DIM = 128  # the head dim cuDNN's attention was measured faster at (_cudnn_rows)
CUDNN_TOKENS = 8192  # cuDNN attends blocks of a multiple of this many keys: the full blocks, a bounded set of shapes
MIN_PIECE = 1024  # tokens: the shortest piece of a block that is its own batch entry
ROWS_PER_CTA = 128  # query rows of one CTA of the fused attention's forward kernel (head_dim <= 128 on sm_90)
PIECE_CTAS_PER_SM = 2  # pieces are added while the grid stays within this many CTAs per SM
DECODE_COLUMNS = 512  # query columns per KV head (tiles of 16, one pass over the pages each) up to which the decode
# kernel attends the packed pages (PackedPrefix) rather than dequantized blocks, which read them once in all
PREFILL_COLUMNS = 512  # query columns per KV head up to which the arch's prefill kernel attends the packed pages
# (PackedPrefill), where it has one (Hopper), before the decode kernel's and the blocks' limits are asked: over 100K
# INT2 tokens on the H200 it took 993 us at 128 tokens (gqa 4; decode kernel 1392, blocks 1633) and tied the decode
# kernel at 16 (769 / 785); at 1K the blocks were twice as fast (2960 / 6028; benchmarks/NOTES.md section 58)
HELD_BYTES = 64 << 20  # FP32 bytes of partial outputs Merged holds before it merges them (its working memory)
HELD_PART_BYTES = 256 << 20  # bytes of partials (their own dtype) MergedParts holds before it merges them


def fused_attention(q, k, v, sm_scale: float, causal: bool, cudnn: bool = False):
    """``(out [B, H, L, D] in q's dtype, lse [B, H, L] fp32, natural log of the scaled scores)`` of
    ``q [B, H, L, D]`` over ``k, v [B, H, T, D]`` (same heads; the last dim contiguous, other strides free: a
    block's pieces come as strided views).

    On a GPU, FlashAttention-2, or with ``cudnn`` cuDNN's fused attention, which measured about twice as fast at
    head_dim 128 where compute-bound (``benchmarks/NOTES.md`` section 22) but plans each new shape once (the
    caller keeps to a bounded set of shapes: :func:`_cudnn_rows`)."""
    if q.is_cuda and cudnn:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                      scale=sm_scale)[:2]
    elif q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=sm_scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=sm_scale)
    return out, lse.reshape(out.shape[:-1])


class Merged:
    """Partial attentions of the same query rows merged by their LSE, in FP32. A partial is a batch ``out
    [P, *rows, D]`` (any float dtype), ``lse [P, *rows]`` of ``P`` attentions over disjoint tokens, each non-empty
    (a finite lse). Partials are held and merged together, when they hold ``HELD_BYTES`` and at :meth:`result`:
    a few torch ops per merge rather than a dozen per partial, since the host's work per op bounds a short chunk
    (``benchmarks/NOTES.md`` section 26)."""

    def __init__(self):
        self.out: torch.Tensor | None = None  # fp32 [*rows, D]: the partials merged so far
        self.lse: torch.Tensor | None = None  # fp32 [*rows]
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._held_bytes = 0

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        self._held.append((out, lse.float()))
        self._held_bytes += 4 * out.numel()  # what its weighted FP32 copy takes in the merge
        if self._held_bytes >= HELD_BYTES:
            self._merge()

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out fp32 [*rows, D], lse fp32 [*rows])`` of everything added (the merged state itself: a later
        :meth:`add` changes it in place)."""
        if self._held:
            self._merge()
        return self.out, self.lse

    def _merge(self) -> None:
        lse = torch.cat(([] if self.lse is None else [self.lse[None]]) + [lse for _, lse in self._held])
        total = torch.logsumexp(lse, 0)
        weights = (lse - total).exp_()[..., None]  # [N, *rows, 1]: each attention's share of the softmax
        first = 0 if self.out is None else 1
        if self.out is not None:
            self.out.mul_(weights[0])
        for out, _ in self._held:
            share = weights[first:first + out.shape[0]]  # FP32: a 16-bit out's products are FP32
            if self.out is None:  # the first partial's weighted sum starts the FP32 sum (no zeros to add to)
                self.out = (torch.mul(out[0], share[0]) if out.shape[0] == 1 else (out * share).sum(0)).float()
            elif out.shape[0] == 1:
                self.out.addcmul_(out[0], share[0])
            else:
                self.out.add_((out * share).sum(0))
            first += out.shape[0]
        self.lse, self._held, self._held_bytes = total, [], 0


class MergedParts:
    """:class:`Merged` on a GPU: the partials (views of the fused attentions' outputs, each read once) merged by
    ``merge`` (``foscar.kernels.merge_parts.merge_parts``, one launch), straight into the chunk's output layout. The
    partials held past ``HELD_PART_BYTES`` merge into an FP32 running part first. ``add`` takes :class:`Merged`'s
    batches (rows ``g * L + t`` of a KV head), :meth:`add_part` a part ``o [kv_heads, gqa, L, D]``, ``lse
    [kv_heads, gqa, L]`` (any strides, channels contiguous)."""

    def __init__(self, merge: Callable, group: int, tokens: int):
        self.merge, self.group, self.tokens = merge, group, tokens
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._held_bytes = 0
        self._running: tuple[torch.Tensor, torch.Tensor] | None = None  # fp32 (o, lse) of the parts merged so far

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        for o, part_lse in zip(out, lse):  # [kv_heads, gqa * L, D] -> [kv_heads, gqa, L, D]: views
            self.add_part(o.unflatten(1, (self.group, self.tokens)), part_lse.unflatten(1, (self.group, self.tokens)))

    def add_part(self, o: torch.Tensor, lse: torch.Tensor) -> None:
        self._held.append((o, lse))
        self._held_bytes += o.numel() * o.element_size()
        if self._held_bytes >= HELD_PART_BYTES:
            parts = self._parts()
            if self._running is None:
                self._running = (torch.empty(o.shape, dtype=torch.float32, device=o.device),
                                 torch.empty(o.shape[:-1], dtype=torch.float32, device=o.device))
            self.merge(parts, *self._running)  # in place where it is a part: each row is read before it is written
            self._held, self._held_bytes = [], 0

    def result(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [L, Hq, D] in dtype, lse [L, Hq] fp32)`` of everything added."""
        parts = self._parts()
        kv_heads, _, tokens, d = parts[0][0].shape
        out = torch.empty(tokens, kv_heads * self.group, d, dtype=dtype, device=parts[0][0].device)
        lse = torch.empty(tokens, kv_heads * self.group, dtype=torch.float32, device=out.device)
        # (kv_heads, gqa, L, D) and (kv_heads, gqa, L) views of them
        self.merge(parts, out.view(tokens, kv_heads, self.group, d).permute(1, 2, 0, 3),
                   lse.view(tokens, kv_heads, self.group).permute(1, 2, 0))
        return out, lse

    def _parts(self):
        return self._held + ([self._running] if self._running is not None else [])


@functools.cache
def _sm_count(device: torch.device) -> int:  # (foscar.jit.sm_count's query: this core module imports no layer above)
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pieces(rows: int, kv_heads: int, tokens: int, device: torch.device) -> int:
    """How many pieces one block's attention of ``rows`` query rows per KV head splits into (a batch)."""
    if device.type != "cuda":
        return 1
    ctas = kv_heads * -(-rows // ROWS_PER_CTA)
    wanted = PIECE_CTAS_PER_SM * _sm_count(device) // ctas  # rounded down: 256 CTAs on 132 SMs stay one piece
    return max(1, min(wanted, tokens // MIN_PIECE))


def _cudnn_rows(rows: int, k) -> int | None:
    """The padded query rows per KV head with which cuDNN attends a block ``k [kv_heads, T, D]``, or None (FA2): on
    a GPU with cuDNN, head_dim 128 and ``T`` a multiple of ``CUDNN_TOKENS``, ``rows`` rounded up to four sizes per
    octave (at most 25% more rows). The shapes cuDNN sees are then a bounded set, each planned once per process,
    whatever the prefix length and the chunk length."""
    if not (k.is_cuda and k.shape[2] == CUDNN_HEAD_DIM and torch.backends.cudnn.is_available()
            and k.shape[1] % CUDNN_TOKENS == 0):
        return None
    return padded_rows(rows)


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of ``2^(k-2)`` for ``2^k <= rows < 2^(k+1)``: four sizes per octave, at most
    25% more rows."""
    step = 1 << max(0, rows.bit_length() - 3)
    return -(-rows // step) * step


def _attend_block(queries, rows: int, k, v, sm_scale: float, merged: Merged | MergedParts) -> None:
    """Merge the attention of the chunk's ``rows`` query rows per KV head (``queries(rows, pieces)``: them as a batch
    ``[pieces, kv_heads, rows, D]``) over one fully visible block ``k, v [kv_heads, T, D]``: cut into ``_pieces``
    (views: the fused attention takes the pieces' strides), any rest its own attention."""
    kv_heads, tokens = k.shape[:2]
    padded = _cudnn_rows(rows, k)
    cudnn = padded is not None
    pieces = _pieces(padded or rows, kv_heads, tokens, k.device)
    if cudnn:  # a power of two divides a block of a multiple of CUDNN_TOKENS: no leftover shape for cuDNN to plan
        pieces = 1 << (pieces.bit_length() - 1)
    span = tokens // pieces
    # (pieces, kv_heads, span, D): piece i holds tokens i*span .. (i+1)*span - 1 of every head
    k_pieces, v_pieces = (x[:, :pieces * span].unflatten(1, (pieces, span)).transpose(0, 1) for x in (k, v))
    out, lse = fused_attention(queries(padded or rows, pieces), k_pieces, v_pieces, sm_scale, causal=False,
                               cudnn=cudnn)
    merged.add(out[:, :, :rows], lse[:, :, :rows])  # padded rows (cuDNN's zeros) dropped
    if pieces * span < tokens:
        k_rest, v_rest = (x[None, :, pieces * span:] for x in (k, v))
        out, lse = fused_attention(queries(rows, 1), k_rest, v_rest, sm_scale, causal=False)
        merged.add(out, lse)


@dataclass(frozen=True)
class PackedPrefix:
    """The packed pages of a prefix, attended by the folded decode kernel instead of dequantized blocks: the chunk's
    tokens become more query heads of a decode, ``step`` tokens per launch column tile (``gqa x step`` columns per
    KV head; every token sees the whole prefix, so no mask), and the ``n`` tiles of a chunk are ``n`` sequences of one
    launch that share the prefix's pages. ``decode(q [n, kv_heads * gqa * step, D])`` returns that decode's ``(out,
    lse)``, in q's dtype and fp32."""

    step: int
    decode: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

    def attend(self, q: torch.Tensor, q_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [L, Hq, D]`` (its rows ``q_rows [kv_heads, gqa * L, D]`` unused) over the prefix: one partial ``(out [1,
        kv_heads, gqa * L, D], lse [1, kv_heads, gqa * L])``, the rows of :func:`chunk_attention`'s blocks (row ``g * L
        + t``)."""
        tokens, q_heads, d = q.shape
        kv_heads = q_rows.shape[0]
        group, n = q_heads // kv_heads, -(-tokens // self.step)
        # zero tokens past the chunk (pad copies, so none where the tiles hold it exactly)
        padded = q if n * self.step == tokens else torch.nn.functional.pad(q, (0, 0, 0, 0, 0, n * self.step - tokens))
        # [n, step, kv_heads, gqa, D] -> [n, kv_heads, step, gqa, D]: column t * gqa + g of a KV head's tile
        # (contiguous: the kernel reads rows densely, and q may be a transposed view)
        folded = padded.reshape(n, self.step, kv_heads, group, d).transpose(1, 2).reshape(n, -1, d).contiguous()
        if folded.data_ptr() % 16:  # q itself (nothing above copied it), at an offset the kernel's loads cannot take
            folded = folded.clone()
        out, lse = self.decode(folded)
        out = out.view(n, kv_heads, self.step, group, d).permute(1, 3, 0, 2, 4).reshape(kv_heads, group, -1, d)
        lse = lse.view(n, kv_heads, self.step, group).permute(1, 3, 0, 2).reshape(kv_heads, group, -1)
        return (out[:, :, :tokens].reshape(1, kv_heads, group * tokens, d),
                lse[:, :, :tokens].reshape(1, kv_heads, group * tokens))


@dataclass(frozen=True)
class PackedPrefill:
    """The packed pages of a prefix, attended by the arch's prefill kernel (``foscar.hopper.prefill``): the chunk's
    query rows of a KV head (row ``g * L + t``) are the M side of its products, 128 to a CTA, and each packed tile is
    dequantized once per CTA into shared memory, never written to global memory in 16 bits. ``run(q_rows [kv_heads,
    rows, D])`` returns its splits' partials ``(out [splits, kv_heads, rows, D], lse [splits, kv_heads, rows])``."""

    run: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

    def attend(self, q: torch.Tensor, q_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_rows`` over the prefix: the splits' partials (``q`` unused: the rows are what the kernel reads)."""
        return self.run(q_rows)


def chunk_attention(q, k_new, v_new, blocks, sm_scale: float, packed: PackedPrefix | PackedPrefill | None = None,
                    merge: Callable | None = None):
    """Attention of ``L`` new tokens ``q [L, Hq, D]`` over the cached ``blocks`` (an iterable of ``(k, v)``
    ``[kv_heads, T, D]`` in q's dtype, each fully visible; empty ones are skipped), the ``packed`` prefix where
    given (fully visible too), and, causally, their own ``k_new, v_new [kv_heads, L, D]``. Returns ``out [L, Hq,
    D]`` (q's dtype) and ``lse [L, Hq]`` (fp32). ``merge``: the GPU's merge kernel (:class:`MergedParts`), else
    the partials merge by torch ops (:class:`Merged`)."""
    tokens, q_heads, d = q.shape
    kv_heads = k_new.shape[0]
    group = q_heads // kv_heads
    q_by_head = q.transpose(0, 1).contiguous()  # [Hq, L, D]
    q_rows = q_by_head.view(kv_heads, group * tokens, d)  # the gqa heads of a KV head as rows g*L + t

    @functools.cache
    def queries(rows: int, pieces: int):  # [pieces, kv_heads, rows, D]: q_rows, zero rows past the chunk's
        if rows == group * tokens and pieces == 1:
            return q_rows[None]
        padded = torch.nn.functional.pad(q_rows, (0, 0, 0, rows - group * tokens))
        return padded.expand(pieces, -1, -1, -1).contiguous()

    merged = Merged() if merge is None else MergedParts(merge, group, tokens)
    if packed is not None:
        merged.add(*packed.attend(q, q_rows))
    for k, v in blocks:
        if k.shape[1]:
            _attend_block(queries, group * tokens, k, v, sm_scale, merged)
        del k, v  # before the next block is dequantized
    queries.cache_clear()
    # the chunk's own tokens: KV heads as the batch, each broadcast over its gqa query heads (stride 0: no copy
    # where k, v come contiguous; FlashAttention loads a contiguous last dim)
    own_k, own_v = (x.contiguous()[:, None].expand(kv_heads, group, tokens, d) for x in (k_new, v_new))
    out, lse = fused_attention(q_by_head.view(kv_heads, group, tokens, d), own_k, own_v, sm_scale, causal=True)
    if merge is not None:  # [kv_heads, gqa, L, D]
        merged.add_part(out, lse)
        return merged.result(q.dtype)
    merged.add(out.reshape(1, kv_heads, group * tokens, d), lse.reshape(1, kv_heads, group * tokens))
    out, lse = merged.result()
    return (out.reshape(q_heads, tokens, d).transpose(0, 1).to(q.dtype),
            lse.reshape(q_heads, tokens).transpose(0, 1).contiguous())

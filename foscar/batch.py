"""One attention call for a mixed batch over a :class:`~foscar.cache.PagedKVCache`, in the plan/run style of
FlashInfer's batch wrappers (``BatchPrefillWithPagedKVCacheWrapper``): some sequences decode one token, some
verify a few draft tokens, some extend a chunk of a prompt, all in one ragged ``q``.

``plan(seq_ids, qo_indptr)`` once per step (host work: validation, page reservation, grouping), then
``run(layer, q, k, v)`` once per layer. FlashInfer's convention: ``qo_indptr`` (int, ``[batch + 1]``) says that the
new tokens of sequence ``i`` are rows ``qo_indptr[i]:qo_indptr[i + 1]`` of ``q [total_q, q_heads, head_dim]`` and
of ``k, v [total_q, kv_heads, head_dim]``. Each sequence's new tokens attend its cached tokens and, causally,
each other; their K/V are then in the cache (FlashInfer's ``append_paged_kv_cache`` followed by ``run``).
``docs/engines.md`` maps vLLM's and SGLang's attention backends onto this.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .cache import PagedKVCache, PagePoolFull
from .checks import is_int

__all__ = ["BatchAttention"]


class _Group(NamedTuple):
    """Sequences of one plan with the same number of new tokens: one batched cache call."""

    length: int  # new tokens of each sequence
    ids: tuple  # the sequences' cache ids
    rows: torch.Tensor  # their rows of the ragged q, k, v ([len(ids) * length], sequence by sequence)


class _Plan(NamedTuple):
    ids: tuple
    claims: tuple  # each sequence's claim of its slot when planned (PagedKVCache._claims)
    lens: tuple  # new tokens per sequence
    held: torch.Tensor  # [num_layers, batch]: tokens each sequence held in each layer when planned
    total_q: int
    groups: tuple


class BatchAttention:
    """Plan/run attention of a mixed batch of new tokens over ``cache`` (module docstring).

    :meth:`plan` reserves the pages the new tokens need (all or nothing), so :meth:`run`'s appends allocate none;
    it leaves a previous plan in place when it refuses. :meth:`run` of each layer appends that layer's new K/V:
    every layer of the cache runs once per plan (a plan that ran on some layers only must be finished, or the
    sequences truncated back or freed, before the next). Not capturable in a CUDA graph (host planning, and
    ``attend_chunk``); a captured decode step calls ``PagedKVCache.append`` and ``attend`` directly
    (``docs/engines.md``).
    """

    def __init__(self, cache: PagedKVCache):
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a foscar.cache.PagedKVCache, got {type(cache).__name__}")
        self.cache = cache
        self._plan: _Plan | None = None

    def plan(self, seq_ids, qo_indptr) -> None:
        """Plan a step: ``seq_ids`` (cache sequence ids, no repeats) get ``qo_indptr[i + 1] - qo_indptr[i] >= 1``
        new tokens each (``qo_indptr``: a 1-D int32/int64 tensor, on any device, or a list of ints, starting at 0).
        Reserves their pages; every argument is checked first (ValueError/TypeError naming it, PagePoolFull when
        the pool cannot hold the new tokens), and a refused plan changes nothing. A previous plan that ran on some
        layers but not all is refused too: its sequences' layers would hold different tokens from then on."""
        cache = self.cache
        cache._no_capture("BatchAttention.plan")
        held = cache.seq_lens(seq_ids)  # validates seq_ids
        ids = tuple(int(s) for s in seq_ids)
        offsets = _offsets(qo_indptr, ids)
        lens = tuple(end - start for start, end in zip(offsets, offsets[1:]))
        self._check_finished()
        self._reserve(ids, held.max(0).values.tolist(), lens)
        claims = tuple(cache._claims[s] for s in ids)
        self._plan = _Plan(ids, claims, lens, held, offsets[-1], self._groups(ids, offsets))

    def _check_finished(self) -> None:
        """Refuse to replace a plan whose sequences ran on some layers and not on others (still their claim)."""
        plan, cache = self._plan, self.cache
        if plan is None:
            return
        for b, (seq, claim, new) in enumerate(zip(plan.ids, plan.claims, plan.lens)):
            if cache._pages[seq] is None or cache._claims[seq] != claim:  # freed since: nothing left to finish
                continue
            now, planned = cache._host_len[:, seq], plan.held[:, b]
            ran, pending = (now == planned + new).tolist(), (now == planned).tolist()
            if any(ran) and any(pending):
                raise ValueError(f"plan: the previous plan ran layers {[i for i, x in enumerate(ran) if x]} of "
                                 f"sequence {seq} but not layers {[i for i, x in enumerate(pending) if x]}: run "
                                 "those layers, truncate the ones that ran (within rollback_limit) or free the "
                                 "sequence before planning again")

    def _reserve(self, ids, held, lens) -> None:
        """Pages for ``held + lens`` tokens per sequence (their longest layer), all or nothing."""
        cache = self.cache
        totals = [n + new for n, new in zip(held, lens)]
        for seq, n, new in zip(ids, held, lens):
            if n + new > cache.max_seq_len:
                raise ValueError(f"qo_indptr: {new} new tokens after the {n} cached of sequence {seq} exceed "
                                 f"max_seq_len={cache.max_seq_len}")
        need = sum(max(0, cache.pages_for(t) - len(cache._pages[s])) for s, t in zip(ids, totals))
        if need > cache.free_pages:
            raise PagePoolFull(f"qo_indptr: the new tokens need {need} more pages, {cache.free_pages} of num_pages="
                               f"{cache.num_pages} are free")
        for seq, total in zip(ids, totals):
            cache.reserve(seq, total)

    def _groups(self, ids, offsets) -> tuple:
        """The plan's sequences grouped by their number of new tokens, shortest first."""
        members: dict[int, list[int]] = {}
        for b, (start, end) in enumerate(zip(offsets, offsets[1:])):
            members.setdefault(end - start, []).append(b)
        groups = []
        for length, batch in sorted(members.items()):
            starts = torch.tensor([offsets[b] for b in batch])
            rows = (starts[:, None] + torch.arange(length)).reshape(-1).to(self.cache.device)
            groups.append(_Group(length, tuple(ids[b] for b in batch), rows))
        return tuple(groups)

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None,
            return_lse: bool = False):
        """Attend the planned new tokens of ``layer`` and append their K/V: ``q [total_q, kv_heads*gqa_ratio,
        head_dim]``, ``k, v [total_q, kv_heads, head_dim]`` (rows by ``qo_indptr``; the cache's dtype and device).

        Returns ``out [total_q, q_heads, head_dim]`` (q's dtype) and, if asked, ``lse [total_q, q_heads]`` (fp32,
        natural log, as ``PagedKVCache.attend``). Everything is checked before the cache changes: the tensors,
        ``sm_scale``, and that ``layer`` still holds what it held when planned (each layer runs once per plan)."""
        plan = self._checked_plan(layer)
        self._check_inputs(plan, q, k, v)
        sm_scale = self.cache._sm_scale(sm_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for group in plan.groups:
            o, group_lse = self._attend_group(layer, group, *(x.index_select(0, group.rows) for x in (q, k, v)),
                                              sm_scale)
            out.index_copy_(0, group.rows, o.reshape(-1, *q.shape[1:]))
            lse.index_copy_(0, group.rows, group_lse.reshape(-1, q.shape[1]))
        return (out, lse) if return_lse else out

    def _attend_group(self, layer, group, q, k, v, sm_scale):
        """``(out, lse)`` of one group (``q [B*L, Hq, D]``, ``k, v [B*L, kv_heads, D]``, sequence by sequence),
        its K/V appended. The one place that picks a cache path by the number of new tokens: up to
        ``cache.max_query_tokens()`` (a decode, a draft to verify) are appended, then attended by ``attend``
        (the decode kernel on a GPU: one launch, causal over the window); more (a chunk) are attended by
        ``attend_chunk`` (over the cached tokens and, causally, their own K/V), then appended."""
        cache, ids, length = self.cache, group.ids, group.length
        batch = len(ids)
        k, v = (x.view(batch, length, *x.shape[1:]).transpose(1, 2) for x in (k, v))  # [B, kv_heads, L, D]
        if length <= cache.max_query_tokens():
            cache.append(layer, ids, k, v)
            q = q if length == 1 else q.view(batch, length, *q.shape[1:])
            return cache.attend(layer, ids, q, sm_scale, return_lse=True)
        out = cache.attend_chunk(layer, ids, q.view(batch, length, *q.shape[1:]), k, v, sm_scale, return_lse=True)
        cache.append(layer, ids, k, v)
        return out

    def _checked_plan(self, layer) -> _Plan:
        """The plan, if its sequences are the claims it was made for and ``layer`` holds what it held when planned
        (the pages plan reserved then stay with the claim: truncate keeps them, free ends the claim)."""
        cache, plan = self.cache, self._plan
        if plan is None:
            raise RuntimeError("BatchAttention.run before plan: call plan(seq_ids, qo_indptr) first")
        cache._no_capture("BatchAttention.run")
        cache._check_layer(layer)
        held = cache.seq_lens(plan.ids)[layer].tolist()  # also refuses sequences freed since
        for seq, claim in zip(plan.ids, plan.claims):
            if cache._claims[seq] != claim:
                raise ValueError(f"layer {layer}: sequence {seq} was freed and allocated again since plan: plan "
                                 "again")
        for seq, n, planned in zip(plan.ids, held, plan.held[layer].tolist()):
            if n != planned:
                raise ValueError(f"layer {layer}: sequence {seq} holds {n} tokens, {planned} when planned: each layer "
                                 "runs once per plan, and the sequences must not change between plan and run (plan "
                                 "again)")
        return plan

    def _check_inputs(self, plan, q, k, v) -> None:
        cache = self.cache
        d, kv_heads = cache.scheme.head_dim, cache.kv_heads
        for name, t, label, heads in (("q", q, "kv_heads*gqa_ratio", kv_heads * cache.scheme.gqa_ratio),
                                      ("k", k, "kv_heads", kv_heads), ("v", v, "kv_heads", kv_heads)):
            cache._check_kind(name, t)
            if list(t.shape) != [plan.total_q, heads, d]:
                raise ValueError(f"{name} must have shape [total_q={plan.total_q} (qo_indptr[-1]), {label}={heads}, "
                                 f"head_dim={d}], got {list(t.shape)}")
        cache._check_values(k, v)  # every group's rows, before the first group appends


def _offsets(qo_indptr, ids) -> list[int]:
    """``qo_indptr`` as a list of ints, checked: ``len(ids) + 1`` entries from 0, growing by at least 1."""
    if isinstance(qo_indptr, torch.Tensor):
        if qo_indptr.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"qo_indptr must be an int32 or int64 tensor, got {qo_indptr.dtype}")
        if qo_indptr.is_meta:
            raise ValueError("qo_indptr must hold values: a meta tensor has none")
        if qo_indptr.dim() != 1:
            raise ValueError(f"qo_indptr must be 1-D, got shape {list(qo_indptr.shape)}")
        offsets = qo_indptr.tolist()
    elif isinstance(qo_indptr, (list, tuple, range)):
        if not all(is_int(x) for x in qo_indptr):
            raise TypeError(f"qo_indptr must hold ints, got {list(qo_indptr)}")
        offsets = [int(x) for x in qo_indptr]
    else:
        raise TypeError(f"qo_indptr must be a 1-D int tensor or a list of ints, got {type(qo_indptr).__name__}")
    if len(offsets) != len(ids) + 1:
        raise ValueError(f"qo_indptr must have len(seq_ids) + 1 = {len(ids) + 1} entries, got {len(offsets)}")
    if offsets[0] != 0:
        raise ValueError(f"qo_indptr must start at 0, got {offsets[0]}")
    for b, (start, end) in enumerate(zip(offsets, offsets[1:])):
        if end <= start:
            raise ValueError(f"qo_indptr must grow by at least 1 per sequence: sequence {ids[b]} (entry {b}) gets "
                             f"{end - start} new tokens")
    return offsets

"""BatchAttention (foscar/batch.py): a mixed batch (decodes of one token, verifies of a few, an extend of a chunk
that crosses a granule and a page) in one plan / run per layer equals the same sequences run one at a time through
PagedKVCache.append + attend and attend_chunk + append, and float64 attention by the project's tolerance rule
(``foscar/testing.py``); the cache afterwards is the one-at-a-time cache; bad arguments are refused before anything
changes. On the CPU (torch path); the GPU test runs the same batch on a kernel cache."""

import math

import pytest
import torch

from foscar import BatchAttention, Scheme
from foscar.cache import PagedKVCache, PagePoolFull
from test_cache import SCHEMES, assert_unchanged, kv, make_cache, snapshot
from test_cache_chunk import assert_within_the_rule, rotated

SM_SCALE = 0.1


def mix(cache):
    """``(cached, new)`` tokens per sequence, in the batch's (ragged) order: a decode whose token completes a
    granule (quantized before it is attended), a verify of 4 and one of 7, an extend of 100 crossing a granule and a
    page, a short decode and a second verify of 4 (the groups of 1 and 4 tokens hold two sequences each, their rows
    interleaved with the others')."""
    due = cache.sink + cache.window + cache.granule - 1
    extend = due + 50
    assert cache.quantized_tokens(due + 1) > cache.quantized_tokens(due)
    assert cache.pages_for(extend + 100) > cache.pages_for(extend) > 0
    return [(due, 1), (due + 60, 4), (extend, 100), (5, 1), (due - 100, 7), (40, 4)]


def prefill(caches, cached, rng):
    """The same random tokens in every cache: ``cached[i]`` for sequence ``i`` of each, in every layer."""
    ids = [[cache.allocate() for _ in cached] for cache in caches]
    scheme = caches[0].scheme
    for layer in range(caches[0].num_layers):
        for b, n in enumerate(cached):
            k, v = kv(rng, scheme, 1, n, heads=caches[0].kv_heads)
            for cache, seqs in zip(caches, ids):
                cache.append(layer, [seqs[b]], k.to(cache.device), v.to(cache.device))
    assert all(seqs == ids[0] for seqs in ids)
    return ids[0]


def ragged(cache, total, rng):
    """Fresh random ``q [total, Hq, D]`` and ``k, v [total, kv_heads, D]`` on the cache's device."""
    scheme = cache.scheme
    q = torch.randn(total, cache.kv_heads * scheme.gqa_ratio, scheme.head_dim, generator=rng).to(scheme.q_dtype)
    k, v = kv(rng, scheme, 1, total, heads=cache.kv_heads)
    return q.to(cache.device), k[0].transpose(0, 1).to(cache.device), v[0].transpose(0, 1).to(cache.device)


def offsets_of(lens):
    return [0] + [sum(lens[:i + 1]) for i in range(len(lens))]


def one_at_a_time(cache, layer, ids, offsets, q, k, v):
    """Each sequence alone: up to ``max_query_tokens`` tokens appended then attended, more attended by
    attend_chunk then appended."""
    outs, lses = [], []
    for seq, start, end in zip(ids, offsets, offsets[1:]):
        k_seq, v_seq = (x[start:end].transpose(0, 1)[None] for x in (k, v))
        if end - start <= cache.max_query_tokens():
            cache.append(layer, [seq], k_seq, v_seq)
            out, lse = cache.attend(layer, [seq], q[None, start:end], SM_SCALE, return_lse=True)
        else:
            out, lse = cache.attend_chunk(layer, [seq], q[None, start:end], k_seq, v_seq, SM_SCALE, return_lse=True)
            cache.append(layer, [seq], k_seq, v_seq)
        outs.append(out.reshape(end - start, *q.shape[1:]))
        lses.append(lse.reshape(end - start, q.shape[1]))
    return torch.cat(outs), torch.cat(lses)


def check_float64(cache, layer, ids, offsets, before, q, k, v, out, lse):
    """Each sequence's rows against float64 attention over what it attended: a decode or a verify, the cache as it
    holds the tokens now (``dense``); a chunk, what it held before (``before``) and its own new K/V. The project's
    rule (``assert_within_the_rule``)."""
    for seq, start, end in zip(ids, offsets, offsets[1:]):
        new_k, new_v = (x[start:end].transpose(0, 1).cpu() for x in (rotated(cache, k), v))
        chunk = end - start > cache.max_query_tokens()
        if not chunk:
            k_all, v_all = (x.cpu() for x in cache.dense(layer, seq))
        else:
            k_all, v_all = (torch.cat([x.cpu(), y.float()], 1) for x, y in zip(before[seq], (new_k, new_v)))
        assert_within_the_rule(out[start:end], lse[start:end], rotated(cache, q[start:end]).cpu(), k_all, v_all,
                               SM_SCALE, (seq, end - start),
                               rounded_partials=chunk and cache._dequantized is None)  # foscar.chunk_attention's


def run_mixed_step(batched, single, ids, lens, rng, indptr_type):
    """One step of ``lens`` new tokens through BatchAttention on ``batched`` and one sequence at a time on
    ``single``, every layer; each layer's outputs equal, and against float64."""
    wrapper = BatchAttention(batched)
    offsets = offsets_of(lens)
    wrapper.plan(ids, indptr_type(offsets))
    for layer in range(batched.num_layers):
        q, k, v = ragged(batched, offsets[-1], rng)
        before = {seq: batched.dense(layer, seq) for seq in ids}
        out, lse = wrapper.run(layer, q, k, v, sm_scale=SM_SCALE, return_lse=True)
        assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:2]
        assert lse.dtype == torch.float32
        want, want_lse = one_at_a_time(single, layer, ids, offsets, q, k, v)
        # batched matmuls (of padded widths) may round the last bit apart from one sequence's; on the GPU the decode
        # kernel cuts a sequence into parts by the batch (foscar.work_list), merged in another order: each lse within
        # the decode tests' 1e-3 of float64, so two of them within 2e-3
        out_tol, lse_tol = ((2**-7, 1e-6), (1e-5, 0)) if not batched.use_kernels else ((0, 1e-2), (0, 2e-3))
        if not (batched.use_kernels and batched.rotation is not None):  # else the caches may differ (assert_same_state)
            assert torch.allclose(out.float(), want.float(), *out_tol), float((out.float() - want.float()).abs().max())
            assert torch.allclose(lse, want_lse, *lse_tol), float((lse - want_lse).abs().max())
        check_float64(batched, layer, ids, offsets, before, q, k, v, out, lse)


def assert_same_state(a, b, ids):
    """The same lengths and pages, and the same values held: bit for bit, but where a GPU rotates the keys (cuBLAS
    picks its matmul by the batch, so a key rotated in a batch of two may round one bit apart from the same key
    alone, and its group quantize then apart too) at most 1e-3 of the elements apart."""
    assert torch.equal(a.lengths, b.lengths) and all(len(a.pages_of(s)) == len(b.pages_of(s)) for s in ids)
    batch_variant = a.use_kernels and a.rotation is not None
    for layer in range(a.num_layers):
        for seq in ids:
            for x, y in zip(a.dense(layer, seq), b.dense(layer, seq)):
                apart = float((x != y).float().mean())
                assert apart <= (1e-3 if batch_variant else 0), (layer, seq, apart)


def test_drafts_past_one_launch_take_the_decode_route_with_a_rollback_margin(rng, monkeypatch):
    """With rollback=6 (and one launch patched to take 2 tokens), groups of up to 8 tokens are appended and
    attended (as several launches), not attend_chunk'ed: the same result as one sequence at a time, and float64.
    The sequences stay inside the sink + window (no granule quantized within a draft: every view reads the same
    values)."""
    monkeypatch.setattr(PagedKVCache, "_tokens_per_launch", lambda self: 2)
    batched, single = (make_cache(SCHEMES[1], max_seqs=4, rollback=6) for _ in range(2))
    assert batched.max_query_tokens() == 8
    routes = []
    monkeypatch.setattr(PagedKVCache, "attend_chunk", lambda *a, **kw: routes.append("chunk"))
    ids = prefill([batched, single], [20, 3, 60], rng)
    run_mixed_step(batched, single, ids, [5, 8, 1], rng, list)
    assert routes == [] and all(batched.seq_len(s) < batched.sink + batched.window for s in ids)
    assert_same_state(batched, single, ids)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda s: s.name)
def test_mixed_batch_equals_one_sequence_at_a_time(scheme, rotate, rng):
    """Two layers; after the mixed step the two caches hold the same tokens (lengths, pages, contents), and a
    following all-decode step through BatchAttention (qo_indptr a list this time) equals append + attend."""
    batched, single = (make_cache(scheme, num_pages=40, max_seqs=8, rotate=rotate) for _ in range(2))
    cached, lens = zip(*mix(batched))
    ids = prefill([batched, single], cached, rng)
    run_mixed_step(batched, single, ids, list(lens), rng, lambda o: torch.tensor(o, dtype=torch.int32))
    assert [batched.seq_len(s, 1) for s in ids] == [n + new for n, new in zip(cached, lens)]
    assert_same_state(batched, single, ids)
    run_mixed_step(batched, single, ids[::-1], [1] * len(ids), rng, list)
    assert_same_state(batched, single, ids)


def test_plan_reserves_the_pages_and_returns_only_out(rng):
    """plan takes the pages the new tokens need (so run allocates none); run without return_lse gives out alone,
    equal to run's out with it."""
    scheme = SCHEMES[1]
    cache, twin = (make_cache(scheme, num_pages=40, max_seqs=8) for _ in range(2))
    ids = prefill([cache, twin], [250, 30], rng)
    wrapper, twin_wrapper = BatchAttention(cache), BatchAttention(twin)
    for w in (wrapper, twin_wrapper):
        w.plan(ids, torch.tensor([0, 300, 301]))
    assert len(cache.pages_of(ids[0])) == cache.pages_for(550) and len(cache.pages_of(ids[1])) == 0
    free = cache.free_pages
    q, k, v = ragged(cache, 301, rng)
    out = wrapper.run(0, q, k, v)
    assert isinstance(out, torch.Tensor) and torch.equal(out, twin_wrapper.run(0, q, k, v, return_lse=True)[0])
    assert cache.free_pages == free and cache.seq_len(ids[0]) == 550 and cache.seq_len(ids[0], layer=1) == 250


def test_rejected_draft_tokens_roll_back(rng):
    """An engine's verify step: four draft tokens run through BatchAttention (next to a decode), three rejected and
    truncated in every layer; the cache is then the one that took only the accepted token, and so is the next step."""
    scheme = SCHEMES[1]
    verified, accepted = (make_cache(scheme, num_pages=40, max_seqs=8) for _ in range(2))
    ids = prefill([verified, accepted], [150, 60], rng)
    wrapper = BatchAttention(verified)
    wrapper.plan(ids, [0, 4, 5])
    for layer in range(verified.num_layers):
        q, k, v = ragged(verified, 5, rng)
        wrapper.run(layer, q, k, v)
        rows = [0, 4]  # the accepted draft token, and the other sequence's decode
        accepted.append(layer, ids, *(x[rows][:, :, None] for x in (k, v)))
    for layer in range(verified.num_layers):
        verified.truncate(layer, [ids[0]], 3)
    assert_same_state(verified, accepted, ids)
    run_mixed_step(verified, accepted, ids, [1, 2], rng, list)
    assert_same_state(verified, accepted, ids)


def errors_cache(rng):
    """Two sequences of 400 and 100 tokens in both layers, a third slot free; 7 pages, 5 of them free."""
    cache = make_cache(SCHEMES[1], num_pages=7, max_seqs=3)
    ids = prefill([cache], [400, 100], rng)
    assert cache.free_pages == 5 and cache.pages_for(600) == 4 and cache.pages_for(1000) == 7
    return cache, ids


def test_plan_errors_name_the_argument_and_leave_the_cache_unchanged(rng):
    cache, (a, b) = errors_cache(rng)
    wrapper = BatchAttention(cache)
    snap = snapshot(cache)
    bad = [
        (TypeError, "seq_ids must be a list", lambda: wrapper.plan(torch.tensor([a, b]), [0, 1, 2])),
        (ValueError, "seq_ids must not be empty", lambda: wrapper.plan([], [0])),
        (ValueError, "seq_ids: unknown sequence id 2", lambda: wrapper.plan([a, 2], [0, 1, 2])),
        (ValueError, "seq_ids must not repeat a sequence", lambda: wrapper.plan([a, a], [0, 1, 2])),
        (TypeError, "qo_indptr must be an int32 or int64 tensor, got torch.float32",
         lambda: wrapper.plan([a, b], torch.tensor([0.0, 1.0, 2.0]))),
        (ValueError, r"qo_indptr must be 1-D, got shape \[1, 3\]",
         lambda: wrapper.plan([a, b], torch.tensor([[0, 1, 2]]))),
        (ValueError, "qo_indptr must hold values: a meta tensor has none",
         lambda: wrapper.plan([a, b], torch.zeros(3, dtype=torch.int64, device="meta"))),
        (TypeError, "qo_indptr must hold ints", lambda: wrapper.plan([a, b], [0, 1.0, 2])),
        (TypeError, "qo_indptr must hold ints", lambda: wrapper.plan([a, b], [0, True, 2])),
        (TypeError, "qo_indptr must be a 1-D int tensor or a list of ints, got NoneType",
         lambda: wrapper.plan([a, b], None)),
        (ValueError, r"qo_indptr must have len\(seq_ids\) \+ 1 = 3 entries, got 2",
         lambda: wrapper.plan([a, b], [0, 1])),
        (ValueError, "qo_indptr must start at 0, got 1", lambda: wrapper.plan([a, b], [1, 2, 3])),
        (ValueError, rf"at least 1 per sequence: sequence {b} \(entry 1\) gets 0 new tokens",
         lambda: wrapper.plan([a, b], [0, 2, 2])),
        (ValueError, rf"sequence {a} \(entry 0\) gets -1 new tokens", lambda: wrapper.plan([a, b], [0, -1, 2])),
        (ValueError, rf"qo_indptr: 1101 new tokens after the 400 cached of sequence {a} exceed max_seq_len=1500",
         lambda: wrapper.plan([b, a], [0, 1, 1102])),
        # b (4 pages for 600 tokens) or a (5 more for 1000) would fit alone, not both: neither is reserved
        (PagePoolFull, "qo_indptr: the new tokens need 9 more pages, 5 of num_pages=7 are free",
         lambda: wrapper.plan([b, a], [0, 500, 1100])),
    ]
    for error, message, call in bad:
        with pytest.raises(error, match=message):
            call()
        assert_unchanged(cache, snap)
    with pytest.raises(RuntimeError, match="before plan"):  # every plan above was refused
        wrapper.run(0, *ragged(cache, 2, rng))
    wrapper.plan([a, b], [0, 1, 2])
    assert len(cache.pages_of(a)) == cache.pages_for(401)
    with pytest.raises(PagePoolFull):  # a refused plan keeps the previous one
        wrapper.plan([b, a], [0, 500, 1100])
    wrapper.run(0, *ragged(cache, 2, rng))
    assert [cache.seq_len(s) for s in (a, b)] == [401, 101]


def test_run_errors_name_the_argument_and_leave_the_cache_unchanged(rng):
    cache, (a, b) = errors_cache(rng)
    wrapper = BatchAttention(cache)
    wrapper.plan([b, a], torch.tensor([0, 3, 4], dtype=torch.int64))
    snap = snapshot(cache)
    q, k, v = ragged(cache, 4, rng)
    bad = [
        (ValueError, "layer must be", lambda: wrapper.run(2, q, k, v)),
        (ValueError, r"q must have shape \[total_q=4 \(qo_indptr\[-1\]\), kv_heads\*gqa_ratio=4, head_dim=64\], got "
                     r"\[3, 4, 64\]", lambda: wrapper.run(0, q[:3], k, v)),
        (ValueError, r"q must have shape .* got \[4, 2, 64\]", lambda: wrapper.run(0, q[:, :2], k, v)),
        (ValueError, r"k must have shape \[total_q=4 \(qo_indptr\[-1\]\), kv_heads=2, head_dim=64\], got \[4, 4, 64\]",
         lambda: wrapper.run(0, q, k.repeat(1, 2, 1), v)),
        (ValueError, r"v must have shape .* got \[5, 2, 64\]", lambda: wrapper.run(0, q, k, torch.cat([v, v[:1]]))),
        (ValueError, r"k must have shape .* got \[4, 2, 32\]", lambda: wrapper.run(0, q, k[..., :32], v)),
        (TypeError, "q must have dtype torch.bfloat16", lambda: wrapper.run(0, q.float(), k, v)),
        (TypeError, "v must be a torch.Tensor", lambda: wrapper.run(0, q, k, None)),
        (ValueError, "k must be on the cache's device cpu", lambda: wrapper.run(0, q, k.to("meta"), v)),
        (ValueError, "sm_scale must be None or a positive finite float", lambda: wrapper.run(0, q, k, v,
                                                                                            sm_scale=math.inf)),
        # a non-finite value in the last group's rows: refused before the first group appends
        (ValueError, "v holds inf or nan", lambda: wrapper.run(0, q, k, torch.cat([v[:3], v[3:] * math.nan]))),
        (TypeError, "cache must be a foscar.cache.PagedKVCache", lambda: BatchAttention(None)),
    ]
    for error, message, call in bad:
        with pytest.raises(error, match=message):
            call()
        assert_unchanged(cache, snap)
    wrapper.run(0, q, k, v)
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=rf"layer 0: sequence {b} holds 103 tokens, 100 when planned: each layer "
                                         "runs once per plan"):
        wrapper.run(0, q, k, v)
    assert_unchanged(cache, snap)
    cache.truncate(1, [a], 1)  # layer 1 changed since plan
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=rf"layer 1: sequence {a} holds 399 tokens, 400 when planned"):
        wrapper.run(1, q, k, v)
    assert_unchanged(cache, snap)


def test_run_refuses_a_sequence_freed_since_plan(rng):
    """A sequence freed after plan is refused by name; one freed and allocated again (the same id and length 0, as
    planned) too, whether or not its new claim holds the pages plan reserved."""
    cache, (a, b) = errors_cache(rng)
    wrapper = BatchAttention(cache)
    wrapper.plan([a, b], [0, 1, 300])
    q, k, v = ragged(cache, 301, rng)
    cache.free(b)
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=f"seq_ids: unknown sequence id {b}"):
        wrapper.run(0, q, k, v)
    assert_unchanged(cache, snap)
    assert cache.allocate() == b
    for tokens in (300, 5):  # 5: a first chunk that needs no pages, so only the claim tells the two apart
        wrapper.plan([b], [0, tokens])
        cache.free(b)
        assert cache.allocate() == b
        snap = snapshot(cache)
        with pytest.raises(ValueError, match=f"layer 0: sequence {b} was freed and allocated again since plan"):
            wrapper.run(0, q[:tokens], k[:tokens], v[:tokens])
        assert_unchanged(cache, snap)


def test_plan_refuses_to_replace_a_plan_that_ran_on_some_layers_only(rng):
    """Planning again after a plan ran on layer 0 but not layer 1 would leave the layers holding different tokens:
    refused, naming the layers; once the layer that ran is truncated back (or the rest run), plan goes on."""
    cache = PagedKVCache(Scheme.make(4, "token", 64, "token", 64, 64, 2), 2, 2, 20, 4, 1500, sink=16, window=128)
    a = cache.allocate()
    wrapper = BatchAttention(cache)
    wrapper.plan([a], [0, 10])
    wrapper.run(0, *ragged(cache, 10, rng))
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"previous plan ran layers \[0\] of sequence 0 but not layers \[1\]"):
        wrapper.plan([a], [0, 1])
    assert_unchanged(cache, snap)
    cache.truncate(0, [a], 10)
    wrapper.plan([a], [0, 1])  # the layers even again
    for layer in (0, 1):
        wrapper.run(layer, *ragged(cache, 1, rng))
    assert cache.seq_lens([a]).flatten().tolist() == [1, 1]
    wrapper.plan([a], [0, 3])  # the last plan ran on every layer


GPU_SCHEMES = [Scheme.make(2, "channel", 128, "token", 128, 128, 4), Scheme.make(4, "token", 128, "token", 128, 128, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("scheme", GPU_SCHEMES, ids=lambda s: s.name)
def test_mixed_batch_on_a_kernel_cache(scheme, rotate, rng):
    """The mixed batch on a CUDA cache (decodes through the decode kernel, chunks through attend_chunk's torch
    code), two layers, against float64 and against the same sequences one at a time on a second CUDA cache; then an
    all-decode step; the caches' contents stay equal."""
    batched, single = (PagedKVCache(scheme, 2, 2, 48, 8, 4096, sink=64, window=256, rotate=rotate, device="cuda")
                       for _ in range(2))
    assert batched.use_kernels
    cached, lens = zip(*mix(batched))
    ids = prefill([batched, single], cached, rng)
    run_mixed_step(batched, single, ids, list(lens), rng, lambda o: torch.tensor(o, dtype=torch.int32, device="cuda"))
    assert_same_state(batched, single, ids)
    run_mixed_step(batched, single, ids[::-1], [1] * len(ids), rng, list)
    assert_same_state(batched, single, ids)

"""``PagedKVCache.attend`` of several query tokens per sequence (speculative verification: the draft tokens
appended first, then attended causally: query token ``t`` of ``L`` sees the sequence's tokens up to its own),
against float64 attention over what the cache holds (``PagedKVCache.dense``) with the causal mask: the CPU
torch path here, the Hopper kernel (``foscar.query_rows``: gqa x tokens query columns, the causal mask on the
window tiles) in the GPU tests; the kernels' limits and the errors, which leave the cache unchanged."""

import copy
import math

import pytest
import torch

from foscar import Scheme
from foscar.archs import BLACKWELL, HOPPER
from foscar.cache import PagedKVCache
from foscar.testing import causal_references
from test_cache import SCHEMES, assert_unchanged, kv, make_cache, snapshot
from test_cache_chunk import assert_within_the_rule, rotated


def causal_attention(q, k, v, sm_scale):
    """float64 ``(out, lse)`` of ``q [L, Hq, D]``, the last ``L`` of the ``n`` tokens of ``k, v [kvh, n, D]``."""
    return causal_references(q, k, v, sm_scale)[:2]


def check_verify(cache, ids, tokens, rng, layer=0, sm_scale=0.1, atol=1e-2, low_dtype=None):
    """Append ``tokens`` fresh random tokens to ``ids`` and attend them; returns the error and the tolerance
    (``atol``, or with ``low_dtype`` 2x the error of the same attention in that dtype + 1e-5) of the sequence whose
    error is furthest past (or least within) its own tolerance."""
    scheme, dev = cache.scheme, cache.device
    k_new, v_new = kv(rng, scheme, len(ids), tokens, heads=cache.kv_heads)
    cache.append(layer, ids, k_new.to(dev), v_new.to(dev))
    q = torch.randn(len(ids), tokens, cache.kv_heads * scheme.gqa_ratio, scheme.head_dim, generator=rng)
    q = q.to(scheme.q_dtype).to(dev)
    out, lse = cache.attend(layer, ids, q, sm_scale=sm_scale, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    checked = []  # (error, tolerance) of each sequence
    for b, seq in enumerate(ids):
        k, v = cache.dense(layer, seq)
        qb = cache._rotate(q[b]).cpu()
        ref, ref_lse = causal_attention(qb, k.cpu(), v.cpu(), sm_scale)
        err = float((out[b].cpu().double() - ref).abs().max())
        assert math.isfinite(err), seq
        lse_err = float((lse[b].cpu().double() - ref_lse).abs().max())
        if low_dtype is None:  # the torch path: fp32 softmax over the same fp32 values, the output in q's dtype
            assert lse_err / float(ref_lse.abs().clamp_min(1).min()) < 1e-4, seq
            # (a BF16 output of |o| ~ 4 rounds by up to 0.016 on its own: atol alone failed seed 1827394871)
            tol = atol + float((ref.to(out.dtype).double() - ref).abs().max())
        else:  # the kernel: scores of the 16-bit q, fp32 exp2 sums (the decode tests' lse rule)
            low, _ = causal_attention(qb.to(low_dtype), k.to(low_dtype).cpu(), v.to(low_dtype).cpu(), sm_scale)
            tol = 2 * float((low.to(low_dtype).double() - ref).abs().max()) + 1e-5
            assert lse_err <= max(tol, 1e-3), (seq, lse_err)
        checked.append((err, tol))
    return max(checked, key=lambda pair: pair[0] - pair[1])


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_attend_of_several_tokens_is_causal_over_the_cache(scheme, rotate, rng):
    """Sequences inside the sink, inside the window and long (three parts); draft counts 1..16 appended in turn,
    so the query tokens cross the sink's end, the ring's wrap and a granule's flush."""
    cache = make_cache(scheme, rotate=rotate, num_pages=40)
    ids = [cache.allocate() for _ in range(3)]
    for i, n in zip(ids, [3, 140, 700]):
        k, v = kv(rng, scheme, 1, n)
        cache.append(0, [i], k, v)
    for tokens in [2, 16, 4, 1, 8, 13]:
        err, tol = check_verify(cache, ids, tokens, rng)
        assert err < tol, (tokens, err)


@pytest.mark.parametrize("draft", [4, 16])
def test_speculative_steps_roll_back_rejected_drafts_with_a_rollback_margin(draft, rng):
    """Append a draft, verify it, keep a random prefix (truncate the rest): with ``rollback=draft + 1`` every
    truncate succeeds, across flushes, and the cache then holds what appending only the kept tokens gives."""
    scheme = SCHEMES[1]  # granule 64: a flush every 64 tokens
    cache, kept = (make_cache(scheme, window=64, num_pages=40, rollback=draft + 1) for _ in range(2))
    assert cache.ring == 64 + 64 + 64 * -(-draft // 64)
    ids = [cache.allocate()]
    assert kept.allocate() == ids[0]
    k, v = kv(rng, scheme, 1, 150)
    cache.append(0, ids, k, v)
    kept.append(0, ids, k, v)
    for _ in range(40):
        k_new, v_new = kv(rng, scheme, 1, draft)
        cache.append(0, ids, k_new, v_new)
        q = torch.randn(1, draft, 2 * scheme.gqa_ratio, scheme.head_dim, generator=rng).to(scheme.q_dtype)
        cache.attend(0, ids, q)
        accept = int(torch.randint(0, draft + 1, (1,), generator=rng))
        assert cache.rollback_limit(ids[0]) >= draft + 1 - accept
        cache.truncate(0, ids, draft - accept)
        kept.append(0, ids, k_new[:, :, :accept], v_new[:, :, :accept]) if accept else None
        assert all(torch.equal(a, b) for a, b in zip(cache.dense(0, ids[0]), kept.dense(0, ids[0])))


def test_without_a_margin_a_flush_limits_the_rollback(rng):
    """The default ring: ``r`` tokens after a granule is quantized (the ring reused ``r`` of its slots) only those
    ``r`` go back; a truncate across the quantized granule is refused."""
    scheme = SCHEMES[1]
    cache = make_cache(scheme, window=64)
    ids = [cache.allocate()]
    cache.append(0, ids, *kv(rng, scheme, 1, 16 + 64 + 64 + 3))  # sink 16 + window 64 + a granule + 3
    assert cache.rollback_limit(ids[0]) == 3  # the 3 tokens since the granule was quantized
    with pytest.raises(ValueError, match="rollback_limit"):
        cache.truncate(0, ids, cache.rollback_limit(ids[0]) + 1)


def test_one_query_token_in_4d_equals_the_3d_attend(rng):
    cache = make_cache(SCHEMES[0])
    ids = [cache.allocate() for _ in range(2)]
    cache.append(0, ids, *kv(rng, SCHEMES[0], 2, 400))
    q = torch.randn(2, 2 * SCHEMES[0].gqa_ratio, SCHEMES[0].head_dim, generator=rng).to(SCHEMES[0].q_dtype)
    out3, lse3 = cache.attend(0, ids, q, return_lse=True)
    out4, lse4 = cache.attend(0, ids, q[:, None], return_lse=True)
    assert torch.allclose(out4[:, 0].float(), out3.float(), atol=1e-3) and torch.allclose(lse4[:, 0], lse3, atol=1e-5)


def test_several_tokens_errors_name_q_and_leave_the_cache_unchanged(rng):
    scheme = SCHEMES[1]
    cache = make_cache(scheme, window=64)
    ids = [cache.allocate(), cache.allocate()]
    cache.append(0, ids[:1], *kv(rng, scheme, 1, 300))
    cache.append(0, ids[1:], *kv(rng, scheme, 1, 3))
    hq, d = 2 * scheme.gqa_ratio, scheme.head_dim
    before = snapshot(cache)
    bad = [
        (torch.randn(1, 65, hq, d), "exceed window=64"),  # more than the window holds
        (torch.randn(2, 4, hq, d), "sequence .* holds 3 tokens"),  # the short sequence lacks the draft's tokens
        (torch.randn(1, 0, hq, d), "tokens >= 1"),
        (torch.randn(1, 2, hq + 1, d), "shape"),
        (torch.randn(1, 2, hq, d + 1), "shape"),
    ]
    for q, message in bad:
        with pytest.raises(ValueError, match=f"q.*{message}|{message}"):
            cache.attend(0, ids[:q.shape[0]], q.to(scheme.q_dtype))
    assert_unchanged(cache, before)


def test_kernel_limits_on_query_tokens_are_stated_before_compiling():
    """Both arches: gqa x tokens <= 16 query columns (one query tile), named before anything compiles."""
    gqa4 = Scheme.make(2, "token", 128, "token", 128, 128, 4)
    two_launches = Scheme.make(2, "channel", 256, "token", 128, 256, 8)  # Hopper: the window kernel masks
    for arch, scheme, page_size, limit in ((HOPPER, gqa4, 128, 4), (HOPPER, two_launches, 256, 2),
                                           (BLACKWELL, gqa4, 128, 4)):
        for tokens in range(1, limit + 1):
            arch.check_query_tokens(scheme, page_size, tokens)
        with pytest.raises(ValueError, match=rf"q: {limit + 1} query tokens .* takes 1..{limit} .*16 (rows|columns)"):
            arch.check_query_tokens(scheme, page_size, limit + 1)
    with pytest.raises(ValueError, match="q: 5 query tokens"):
        BLACKWELL.compile_cache_decode(gqa4, 128, tokens=5)


@pytest.mark.parametrize("arch", [HOPPER, BLACKWELL], ids=lambda a: a.name)
@pytest.mark.parametrize("scheme,page_size,tokens", [(Scheme.make(2, "token", 128, "token", 128, 128, 4), 128, 4),
                                                     (Scheme.make(4, "channel", 128, "token", 128, 128, 8), 128, 2),
                                                     (Scheme.make(2, "token", 64, "channel", 64, 64, 1), 128, 16),
                                                     (Scheme.make(2, "channel", 256, "token", 128, 256, 8), 256, 2)],
                         ids=lambda x: getattr(x, "name", str(x)))
def test_cache_decode_of_several_tokens_compiles(arch, scheme, page_size, tokens):
    """The cache decode of ``tokens`` query tokens, and the window kernel that masks them where the arch's decode is
    two launches (Blackwell's; Hopper's head_dim 256 with channel-wise K groups of 256), build on the CPU (Hopper
    runs them in the GPU tests below; Blackwell is compile-verified only)."""
    from foscar.inspect import artifacts
    from foscar.kernels.sink_window import compile_sink_window

    assert artifacts(arch.compile_cache_decode(scheme, page_size, tokens)).sass
    if not arch._fuses_window(scheme, page_size):
        window = compile_sink_window(scheme.head_dim, scheme.gqa_ratio, arch.name, tokens=tokens)
        assert "HMMA" in artifacts(window).sass


# ----------------------------------------------------------------------------- on the H200

GPU_CASES = [  # (scheme, kv_heads, tokens)
    (Scheme.make(2, "token", 128, "token", 128, 128, 4), 2, 4),
    (Scheme.make(2, "channel", 128, "token", 128, 128, 4), 2, 2),
    (Scheme.make(4, "token", 128, "channel", 128, 128, 2), 2, 8),
    (Scheme.make(2, "token", 64, "token", 64, 64, 1), 2, 16),
    (Scheme.make(4, "channel", 128, "token", 128, 128, 8), 1, 2),
    (Scheme.make(2, "token", 128, "token", 128, 128, 3), 2, 5),  # 15 columns: neither n8 block full
    (Scheme.make(4, "token", 128, "token", 128, 256, 2), 1, 4),
    (Scheme.make(2, "token", 128, "token", 128, 128, 4, torch.float16), 2, 3),
    (Scheme.make(2, "channel", 256, "token", 128, 256, 8), 1, 2),  # two launches: the window kernel masks
]


def gpu_cache(scheme, kv_heads, rotate=False):
    return PagedKVCache(scheme, 1, kv_heads, num_pages=96, max_seqs=5, max_seq_len=8192, page_size=None, sink=64,
                        window=256, rotate=rotate, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,kv_heads,tokens", GPU_CASES, ids=[f"{c[0].name}-h{c[1]}-t{c[2]}" for c in GPU_CASES])
def test_kernel_verification_matches_float64(scheme, kv_heads, tokens, rng):
    """Lengths at the part boundaries (inside the sink, the sink's end, inside the window, the first flush,
    long); the draft appended in turn crosses them; budgets 1 (one part per (sequence, KV head)) and many."""
    cache = gpu_cache(scheme, kv_heads, rotate=scheme.k.bits == 2)
    ids = [cache.allocate() for _ in range(5)]
    for i, n in zip(ids, [2, 62, 200, 64 + 256 + 127, 3000]):
        k, v = kv(rng, scheme, 1, n, heads=kv_heads)
        cache.append(0, [i], k.cuda(), v.cuda())
    for budget in (1, 7, 1000):
        cache.cta_budget = budget
        err, tol = check_verify(cache, ids[::-1], tokens, rng, atol=0.0, low_dtype=scheme.q_dtype)
        assert err <= tol, (budget, err, tol)
    assert not cache._counters.any()


@pytest.mark.gpu
def test_kernel_verification_in_a_cuda_graph_equals_eager(rng):
    """A step of 4 one-token appends (the draft) and one verification, captured once and replayed with new
    inputs, equals the same calls run eagerly on a second cache holding the same tokens, bit for bit."""
    scheme = Scheme.make(2, "channel", 128, "token", 128, 128, 4)
    caches = [gpu_cache(scheme, 2) for _ in range(2)]
    k, v = kv(rng, scheme, 2, 1000, heads=2)
    ids = None
    for c in caches:
        seqs = [c.allocate(), c.allocate()]
        assert ids is None or seqs == ids  # the same ids in both caches: one step function serves both
        ids = seqs
        c.append(0, ids, k.cuda(), v.cuda())
        for i in ids:
            c.reserve(i, 1100)
    hq, d = 2 * scheme.gqa_ratio, scheme.head_dim
    draft_k, draft_v = (torch.empty(2, 2, 4, d, dtype=scheme.q_dtype, device="cuda") for _ in range(2))
    q = torch.empty(2, 4, hq, d, dtype=scheme.q_dtype, device="cuda")

    def step(cache):
        for t in range(4):  # one capturable append per draft token, then one verification of all four
            cache.append(0, ids, draft_k[:, :, t:t + 1], draft_v[:, :, t:t + 1])
        return cache.attend(0, ids, q)

    def fresh_inputs():
        for x, y in zip((draft_k, draft_v), kv(rng, scheme, 2, 4, heads=2)):
            x.copy_(y)
        q.copy_(torch.randn(q.shape, generator=rng).to(q))

    fresh_inputs()
    first = [step(c) for c in caches]  # compiles before the capture; both caches stay alike
    assert torch.equal(first[0], first[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(caches[0])
    for _ in range(3):
        fresh_inputs()
        graph.replay()
        eager = step(caches[1])
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
    assert caches[0].lengths.equal(caches[1].lengths)


def check_launches(cache, ids, drafts, rng, sm_scale=0.1):
    """Append drafts of ``drafts`` tokens in turn to ``ids`` and attend each: the launches of
    ``cache._tokens_per_launch()`` tokens, each over the sequence as a truncate of the later tokens leaves it,
    against float64 over that truncated cache with the causal mask (the project's rule); the ring always holds
    what those views read (``rollback_limit``)."""
    scheme, dev, step = cache.scheme, cache.device, cache._tokens_per_launch()
    heads = cache.kv_heads * scheme.gqa_ratio
    for tokens in drafts:
        k, v = kv(rng, scheme, len(ids), tokens, heads=cache.kv_heads)
        cache.append(0, ids, k.to(dev), v.to(dev))
        assert all(cache.rollback_limit(seq) >= tokens - step for seq in ids)
        q = torch.randn(len(ids), tokens, heads, scheme.head_dim, generator=rng).to(scheme.q_dtype)
        out, lse = cache.attend(0, ids, q.to(dev), sm_scale=sm_scale, return_lse=True)
        q_seen = rotated(cache, q)
        for first in range(0, tokens, step):  # the launches: tokens first .. end - 1 of each sequence
            end, view = min(tokens, first + step), copy.deepcopy(cache)
            view.truncate(0, ids, tokens - end)
            for b, seq in enumerate(ids):
                assert_within_the_rule(out[b, first:end], lse[b, first:end], q_seen[b, first:end],
                                       *(x.cpu() for x in view.dense(0, seq)), sm_scale, (tokens, first, seq))


@pytest.mark.parametrize("step", [1, 3])
def test_more_tokens_than_one_launch_takes_run_as_launches_over_truncated_views(step, rng, monkeypatch):
    """Past the tokens one launch takes (patched here to ``step``; gqa x tokens <= 16 on the GPU), ``rollback``
    tokens more run as earlier launches, each over the sequence as a truncate of the later tokens leaves it (a
    granule that the draft's own append quantized is still read in 16 bits there, as a token-by-token decode
    read it): drafts of 1 .. step + rollback tokens across flushes."""
    monkeypatch.setattr(PagedKVCache, "_tokens_per_launch", lambda self: step)
    cache = make_cache(SCHEMES[1], window=64, num_pages=40, rollback=7)  # granule 64: a flush every 64 tokens
    assert cache.max_query_tokens() == step + 7
    ids = [cache.allocate(), cache.allocate()]
    for i, n in zip(ids, [130, 20]):
        k, v = kv(rng, cache.scheme, 1, n)
        cache.append(0, [i], k, v)
    check_launches(cache, ids, [min(t, step + 7) for t in [8, 2, step + 1, 5, 8, 1, 8]], rng)


@pytest.mark.gpu
def test_kernel_launches_past_one_tile_match_float64(rng):
    """On the GPU: gqa 4 takes 4 tokens per launch; with rollback=8, drafts of up to 12 run as up to three launches
    of the decode kernel over shorter views of the sequences, across a flush."""
    scheme = Scheme.make(2, "channel", 128, "token", 128, 128, 4)
    cache = PagedKVCache(scheme, 1, 2, num_pages=64, max_seqs=3, max_seq_len=8192, sink=64, window=256,
                         rotate=True, device="cuda", rollback=8)
    assert cache._tokens_per_launch() == 4 and cache.max_query_tokens() == 12
    ids = [cache.allocate() for _ in range(3)]
    for i, n in zip(ids, [5, 300, 64 + 256 + 120]):
        k, v = kv(rng, scheme, 1, n, heads=2)
        cache.append(0, [i], k.cuda(), v.cuda())
    check_launches(cache, ids, [12, 5, 9, 12, 1, 8], rng)
    assert not cache._counters.any()


def launch_limited_cache(monkeypatch, step, rollback, rng):
    """A CPU cache whose launches take ``step`` tokens (patched), with ``rollback``, one sequence of 400 tokens."""
    monkeypatch.setattr(PagedKVCache, "_tokens_per_launch", lambda self: step)
    cache = make_cache(SCHEMES[1], window=64, num_pages=40, rollback=rollback)
    seq = cache.allocate()
    k, v = kv(rng, cache.scheme, 1, 400)
    cache.append(0, [seq], k, v)
    return cache, seq


def refused(cache, seq, tokens, rng, message):
    """``attend`` of ``tokens`` query tokens raises a ValueError matching ``message`` and changes nothing."""
    before = snapshot(cache)
    q = torch.randn(1, tokens, cache.kv_heads * cache.scheme.gqa_ratio, cache.scheme.head_dim, generator=rng)
    with pytest.raises(ValueError, match=message):
        cache.attend(0, [seq], q.to(cache.scheme.q_dtype))
    assert_unchanged(cache, before)


def test_more_tokens_than_launches_and_rollback_take_name_q_and_change_nothing(rng, monkeypatch):
    cache, seq = launch_limited_cache(monkeypatch, 2, 3, rng)
    refused(cache, seq, 6, rng, r"q: 6 query tokens per sequence: one kernel launch takes 2 and rollback=3 more .* "
                                r"at most 5; construct the cache with rollback >= 4")


def test_launches_refuse_a_view_a_truncate_made_unreadable(rng, monkeypatch):
    """A truncate since the draft's append lowers the margin (rollback_limit): attending existing tokens in several
    launches then needs shorter views than the ring keeps, and is refused, naming q, before anything runs."""
    cache, seq = launch_limited_cache(monkeypatch, 1, 7, rng)
    cache.truncate(0, [seq], cache.rollback_limit(seq))
    assert cache.rollback_limit(seq) == 0
    refused(cache, seq, 2, rng, r"q: 2 query tokens per sequence run as launches of 1; the first reads sequence \d+ "
                                r"without its last 1 tokens, but the ring keeps only 0")

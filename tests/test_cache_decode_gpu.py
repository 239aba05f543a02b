"""The cache decode (foscar.hopper.cache_decode: packed tiles, the 16-bit sink/window tiles and the split merge in
one launch, or two where the window tiles do not fit the ring; and foscar.kernels.sink_window, that second
launch) against the float64
attention over what the cache holds (``PagedKVCache.dense``), every element, tolerance 2x a BF16 torch computation's error.
Ragged lengths cover every part boundary: inside the sink, inside the first window, one granule
quantized, long; sequence ids out of order; one split and many (forced 1, 2, 5 too); GQA 1..16 (one and two n8 blocks
of query columns in the window MMAs, and ratios that fill neither), head_dim 64/128/256, FP16,
rotation, mixed widths."""

import math

import pytest
import torch

from foscar import Scheme
from foscar.cache import PagedKVCache

from device_arch import device_arch, require_arch

pytestmark = pytest.mark.gpu

SINK, WINDOW = 64, 256
FLOOR = 1e-5


def lengths_for(granule):
    """Token counts at each boundary of the sink / window / quantized parts."""
    first_quantized = SINK + WINDOW + granule
    return [1, SINK - 1, SINK + 5, first_quantized - 1, first_quantized, first_quantized + 77, 3001]


CASES = [  # (scheme, page_size, max_seq_len, kv_heads, rotate)
    (Scheme.make(2, "token", 128, "token", 128, 128, 4), 128, 4096, 2, False),
    (Scheme.make(2, "channel", 128, "token", 128, 128, 4), 128, 32768, 2, True),
    (Scheme.make(4, "token", 128, "token", 128, 128, 4), 64, 32768, 2, False),
    (Scheme.make(4, "channel", 64, "channel", 64, 128, 8), 128, 8192, 1, False),
    (Scheme.make(None, "token", 128, "token", 128, 128, 16, k_bits=4, v_bits=2), 128, 8192, 1, False),
    (Scheme.make(None, "channel", 128, "token", 128, 128, 1, k_bits=2, v_bits=4), 256, 8192, 4, False),
    (Scheme.make(2, "token", 64, "token", 64, 64, 4), 128, 8192, 2, False),
    (Scheme.make(4, "token", 128, "channel", 128, 256, 2), 128, 8192, 2, False),
    (Scheme.make(2, "token", 128, "token", 128, 128, 4, torch.float16), 128, 8192, 2, False),
    (Scheme.make(4, "token", 128, "token", 128, 128, 7), 128, 8192, 4, False),  # Qwen2.5-7B's 28 / 4 heads
    (Scheme.make(2, "channel", 128, "token", 128, 128, 5), 128, 8192, 2, False),
    (Scheme.make(4, "token", 64, "token", 64, 64, 3), 128, 8192, 2, False),
    (Scheme.make(2, "token", 128, "token", 128, 256, 6), 128, 8192, 1, False),
    (Scheme.make(4, "token", 128, "token", 128, 256, 11), 128, 8192, 1, False),
    (Scheme.make(2, "token", 128, "token", 128, 256, 16), 128, 8192, 2, False),  # the most shared memory taken
    (Scheme.make(2, "channel", 128, "token", 128, 128, 16), 128, 8192, 1, True),  # 2 consumer warpgroups, spilling
    # gqa 16 at INT4 and with FP16 queries: the configs a 16-column chunk tile or a 4-token verification takes
    (Scheme.make(4, "token", 128, "token", 128, 128, 16), 128, 8192, 1, False),
    (Scheme.make(2, "token", 128, "token", 128, 128, 16, torch.float16), 128, 8192, 1, False),
    # no ring of window-sized stages fits (4 x 4 stages of 16.5 KB): two launches, the window kernel merging
    (Scheme.make(2, "channel", 256, "token", 128, 256, 8), 256, 8192, 2, False),
]


def reference(cache, layer, seq_ids, q, sm_scale, dtype):
    """(float64 out [B, Hq, D], lse [B, Hq]) over ``cache.dense``, and the same attention in ``dtype``."""
    r = q.shape[1] // cache.kv_heads
    qr = cache._rotate(q)  # what attend() attends with
    outs, lses, lows = [], [], []
    for i, s in enumerate(seq_ids):
        k, v = cache.dense(layer, s)  # [kvh, n, D] fp32
        k, v = k.repeat_interleave(r, 0), v.repeat_interleave(r, 0)
        scores = torch.einsum("hd,hnd->hn", qr[i].double(), k.double()) * sm_scale
        outs.append(torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), v.double()))
        lses.append(torch.logsumexp(scores, -1))
        low = torch.einsum("hd,hnd->hn", qr[i].to(dtype), k.to(dtype)) * sm_scale
        lows.append(torch.einsum("hn,hnd->hd", torch.softmax(low.float(), -1).to(dtype), v.to(dtype)))
    return torch.stack(outs), torch.stack(lses), torch.stack(lows)


def attend_matches_float64(cache, order, q):
    """Layer 0's ``attend`` of sequences ``order`` against float64 over what the cache holds, every element (2x the
    error of the same attention in q's dtype); every completion counter left zero."""
    d, dtype = q.shape[-1], q.dtype
    out, lse = cache.attend(0, order, q, sm_scale=d**-0.5, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse, low = reference(cache, 0, order, q, d**-0.5, dtype)
    tol = 2 * float((low.double() - ref).abs().max()) + FLOOR
    err = float((out.double() - ref).abs().max())
    assert math.isfinite(err) and err <= tol, (err, tol)
    assert float((lse.double() - ref_lse).abs().max()) <= max(tol, 1e-3)
    assert not cache._counters.any()


def planned_parts(cache, lengths):
    """The part counts of the work list the cache decode plans over sequences of ``lengths`` tokens
    (``foscar.work_list.host_plan``, the launch's plan mirrored on the CPU)."""
    from foscar.work_list import host_plan

    kernels = cache.arch._kernels()
    scheme, page_size = cache.scheme, cache.page_size
    work = kernels.cache_kernel(kernels.cache_config(scheme, page_size, 1, *kernels.options(scheme, 1))).cache_work
    ring = cache.k_bf16[0].shape[2] - cache.sink
    works, caps = zip(*(work.host_sequence(n, cache.sink, cache.window, ring) for n in lengths))
    return {parts for *_, parts in host_plan(works, caps, cache.kv_heads, launch_budget(cache, lengths))}


def launch_budget(cache, lengths):
    """The budget the cache decode's work list plans sequences of ``lengths`` tokens with (``KernelSet.cache_launch``:
    a wave of ``cache.cta_budget``, or past one wave whole waves of parts of the mean packed tokens)."""
    from foscar.launch import cache_capacity

    kernels, batch = cache.arch._kernels(), len(lengths)
    packed_mean = sum(cache.quantized_tokens(n) for n in lengths) // batch
    return kernels.cache_launch(cache.scheme, cache.page_size, 1, cache_capacity(cache.k_codes[0], cache.page_table,
                                                                                 batch),
                                batch * cache.kv_heads, cache.cta_budget, {}, packed_mean)[1]


def poison_attend_buffers(cache, batch, q, rotate: bool):
    """NaN-fill blocks of the sizes ``attend`` allocates for its outputs and partials and free them
    (after emptying the allocator's cache): the caching allocator hands freed blocks of a size to the
    next requests of that size, so an element the kernels fail to write most likely reads NaN and
    fails the comparison. (Best effort: ``attend`` allocates its buffers itself.)"""
    from foscar.launch import cache_capacity

    hq, d = q.shape[1], q.shape[2]
    kernels = cache.arch._kernels()
    part = kernels.cache_partials(cache.scheme, cache.page_size, batch, cache.kv_heads, cache.num_splits(batch),
                                  cache.cta_budget, cache.sink + cache.ring,
                                  capacity=cache_capacity(cache.k_codes[0], cache.page_table, batch))
    shapes = [((batch, hq, d), q.dtype)] * (2 if rotate else 1)  # the rotated q takes one such block first
    shapes += [((batch, hq), torch.float32), (part, torch.float32), (part[:-1], torch.float32)]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for shape, dtype in shapes]
    del blocks


@pytest.mark.parametrize("scheme,page_size,max_len,kv_heads,rotate", CASES,
                         ids=[f"{c[0].name}-p{c[1]}-max{c[2]}-h{c[3]}{'-rot' if c[4] else ''}" for c in CASES])
def test_one_launch_decode_matches_float64(scheme, page_size, max_len, kv_heads, rotate, rng):
    check_cache_decode(scheme, page_size, max_len, kv_heads, rotate, rng)


@pytest.mark.parametrize("budget", [1, 7, 1000])
@pytest.mark.parametrize("case", [0, 1, 7], ids=lambda i: CASES[i][0].name)
def test_one_launch_decode_any_work_budget(case, budget, rng):
    """The work list (foscar/work_list.py) over a budget of 1 CTA (every (sequence, KV head) one part:
    the CTA writes the output itself), 7 (more (sequence, KV head)s than CTAs: shares rounded up) and
    1000 (up to each sequence's cap): the window tiles ``x, x + parts, ...`` of each part and the merge."""
    check_cache_decode(*CASES[case], rng, budget=budget)


@pytest.mark.parametrize("budget", [7, 21])
def test_repeated_launches_give_the_same_bits(budget, rng):
    """50 launches of one cache decode on the same inputs, bit for bit the first (which matches float64): a race shows
    as a launch that differs. INT4 at head_dim 256 has 8 or 12 ring stages, and these budgets cut the longest sequence
    into 2 or 3 parts of 14 or 9-10 window tiles (``foscar.work_list.host_plan``): the shape where the producers could
    lose a lap (benchmarks/NOTES.md section 49)."""
    check_cache_decode(*CASES[7], rng, budget=budget, repeats=50)


@pytest.mark.parametrize("case", [i for i, (scheme, *_) in enumerate(CASES) if scheme.gqa_ratio == 16],
                         ids=lambda i: CASES[i][0].name)
def test_gqa_16_repeated_launches_give_the_same_bits(case, rng):
    """16 query columns per KV head (two n8 blocks in every window MMA; what a chunk's column tile and a 4-token
    verification at gqa 4 launch): 20 launches bit for bit the first, which matches float64."""
    check_cache_decode(*CASES[case], rng, repeats=20)


def _two_ctas_cases():
    from foscar.hopper.cache_decode import two_ctas_pipeline_with_window
    from foscar.hopper.decode import SHORT_CONTEXT_TOKENS

    return [i for i, (scheme, page_size, max_len, *_) in enumerate(CASES)
            if max_len <= SHORT_CONTEXT_TOKENS and two_ctas_pipeline_with_window(scheme, page_size)]


@pytest.mark.parametrize("case", _two_ctas_cases(), ids=lambda i: CASES[i][0].name)
def test_many_short_sequences_at_two_ctas_per_sm(case, rng, monkeypatch):
    """More (sequence, KV head) pairs than the work list's one-wave budget (the SM count), sequences of at most
    ``SHORT_CONTEXT_TOKENS``: the launch compiles one consumer warpgroup at two CTAs per SM and its work list
    fills twice the budget (``HopperKernels.cache_launch_options``), into NaN-poisoned buffers, against float64."""
    require_arch("sm_90a", "the Hopper cache decode's launch options")
    from foscar.hopper.decode import KERNELS

    asked, cache_decode = [], KERNELS._cache_decode

    def recorded(scheme, page_size, tokens, opts):
        asked.append(opts)
        return cache_decode(scheme, page_size, tokens, opts)

    monkeypatch.setattr(KERNELS, "_cache_decode", recorded)
    scheme, page_size, max_len, kv_heads, rotate = CASES[case]
    pairs = kv_heads * len(lengths_for(1))
    wave = PagedKVCache(scheme, 1, kv_heads, 1, 1, 4096, page_size, SINK, WINDOW, device="cuda").cta_budget
    check_cache_decode(scheme, page_size, max_len, kv_heads, rotate, rng, copies=-(-(wave + 1) // pairs))
    assert asked == [(1, 2)]  # (past one wave of the GPU's SMs)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_two_launch_decode_any_split_count(splits, rng):
    """The two-launch variant (window tiles do not fit the ring) with 1, 2 and 5 splits per sequence."""
    scheme, page_size = CASES[-1][:2]
    if device_arch()._fuses_window(scheme, page_size):
        pytest.skip(f"{device_arch().name} attends {scheme.name}'s window in the decode's own launch")
    check_cache_decode(*CASES[-1], rng, splits=splits)


@pytest.mark.parametrize("budget", [132, 1000])
def test_one_launch_decode_batch_wider_than_the_block(budget, rng):
    """600 sequences (the work list's scans take two rounds of the CTA's threads), 590 short and 10 long
    ones among them, one KV head: against float64 over the cache, every element; counters left zero."""
    scheme, page_size = Scheme.make(2, "token", 128, "token", 128, 128, 4), 128
    lengths = [int(x) for x in torch.randint(1, 700, (600,), generator=rng)]
    for i in range(5, 600, 60):
        lengths[i] = 3000 + i
    cache = PagedKVCache(scheme, 1, 1, num_pages=sum(-(-n // page_size) for n in lengths) + 8, max_seqs=600,
                         max_seq_len=4096, page_size=page_size, sink=SINK, window=WINDOW, device="cuda")
    cache.cta_budget = budget
    ids = [cache.allocate() for _ in lengths]
    d, dtype = scheme.head_dim, scheme.q_dtype
    for seq, n in zip(ids, lengths):
        k = torch.randn(1, 1, n, d, generator=rng) + 2 * torch.randn(d, generator=rng)
        cache.append(0, [seq], k.to("cuda", dtype), torch.randn(1, 1, n, d, generator=rng).to("cuda", dtype))
    order = ids[::-1]
    q = torch.randn(len(order), scheme.gqa_ratio, d, generator=rng).to("cuda", dtype)
    attend_matches_float64(cache, order, q)


@pytest.mark.parametrize("kv_heads", [1, 3])
def test_one_launch_decode_merges_many_parts_in_two_levels(kv_heads, rng):
    """Sequences cut into 3 to MAX_SPLITS parts: in one level up to split_merge.TWO_LEVELS_PAST (9, 13), in two past
    it (17: a last group of one part; 35: of 3; MAX_SPLITS: full groups: the groups' last CTAs merge their groups in
    place, then the last to count merges the groups): against float64, every element; every counter, the group
    counters too, left zero."""
    from foscar.split_merge import GROUP, TWO_LEVELS_PAST
    from foscar.work_list import MAX_SPLITS

    scheme, page_size = Scheme.make(2, "token", 128, "token", 128, 128, 4), 128
    lengths = [MAX_SPLITS * 256 + SINK + WINDOW + 300, 9 * 256 + SINK + WINDOW, 13 * 256 + SINK + WINDOW + 77,
               3 * 256 + SINK + WINDOW, 35 * 256 + SINK + WINDOW + 5, 17 * 256 + SINK + WINDOW]
    cache = PagedKVCache(scheme, 1, kv_heads, num_pages=sum(-(-n // page_size) for n in lengths) + 4,
                         max_seqs=len(lengths), max_seq_len=max(lengths), page_size=page_size, sink=SINK,
                         window=WINDOW, device="cuda")
    cache.cta_budget = 1000  # each sequence up to its cap: quantized tokens / 256 parts, at most MAX_SPLITS
    assert planned_parts(cache, lengths[::-1]) == {3, 9, 13, 17, 35, MAX_SPLITS}  # (attend's order below)
    assert GROUP < 9 < 13 <= TWO_LEVELS_PAST < 17 and 17 % GROUP == 1 and 35 % GROUP == 3 and MAX_SPLITS % GROUP == 0
    ids = [cache.allocate() for _ in lengths]
    d, dtype = scheme.head_dim, scheme.q_dtype
    for seq, n in zip(ids, lengths):
        k = torch.randn(1, kv_heads, n, d, generator=rng) + 2 * torch.randn(d, generator=rng)
        cache.append(0, [seq], k.to("cuda", dtype), torch.randn(1, kv_heads, n, d, generator=rng).to("cuda", dtype))
    order = ids[::-1]
    q = torch.randn(len(order), kv_heads * scheme.gqa_ratio, d, generator=rng).to("cuda", dtype)
    poison_attend_buffers(cache, len(order), q, False)
    for _ in range(2):  # the counters left zero serve the next launch
        attend_matches_float64(cache, order, q)


@pytest.mark.parametrize("budget", [1, 5, 132])
@pytest.mark.parametrize("case", [0, 3, 7], ids=lambda i: CASES[i][0].name)
def test_one_launch_decode_batch_of_one(case, budget, rng):
    """A batch of one sequence (the work list's scan-free path: budget / kv_heads parts per KV head)."""
    check_cache_decode(*CASES[case], rng, budget=budget, only_longest=True)


def check_cache_decode(scheme, page_size, max_len, kv_heads, rotate, rng, splits=None, budget=None,
                       only_longest=False, copies=1, repeats=0):
    """``copies``: how many times the batch holds each of :func:`lengths_for`'s lengths; ``repeats``: launches after
    the first on the same inputs, each bit for bit the first's."""
    lengths = lengths_for(PagedKVCache(scheme, 1, 1, 1, 1, 4096, page_size, SINK, WINDOW, device="meta",
                                       use_kernels=False).granule) * copies
    cache = PagedKVCache(scheme, 2, kv_heads, num_pages=len(lengths) * max_len // page_size + 8,
                         max_seqs=len(lengths) + 1, max_seq_len=max_len, page_size=page_size, sink=SINK, window=WINDOW,
                         rotate=rotate, device="cuda")
    if splits is not None:
        cache.num_splits = lambda batch: splits
    if budget is not None:
        cache.cta_budget = budget
    spare = cache.allocate()  # freed: the ids attended are not 0..B-1
    ids = [cache.allocate() for _ in lengths]
    cache.free(spare)
    d, dtype = scheme.head_dim, scheme.q_dtype
    for seq, n in zip(ids, lengths):
        k = torch.randn(1, kv_heads, n, d, generator=rng) + 2 * torch.randn(d, generator=rng)
        v = torch.randn(1, kv_heads, n, d, generator=rng)
        for layer in range(2):
            cache.append(layer, [seq], k.to("cuda", dtype), v.to("cuda", dtype))
    order = ids[-1:] if only_longest else ids[::-1]  # out of order
    q = torch.randn(len(order), kv_heads * scheme.gqa_ratio, d, generator=rng).to("cuda", dtype)
    sm_scale = 0.7 * d**-0.5
    poison_attend_buffers(cache, len(order), q, rotate)
    out, lse = cache.attend(1, order, q, sm_scale=sm_scale, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse, low = reference(cache, 1, order, q, sm_scale, dtype)
    tol = 2 * float((low.double() - ref).abs().max()) + FLOOR
    err = float((out.double() - ref).abs().max())
    lse_err = float((lse.double() - ref_lse).abs().max())
    print(f"{scheme.name} budget={cache.cta_budget} splits={cache.num_splits(len(order))} err={err:.2e} tol={tol:.2e} "
          f"lse_err={lse_err:.2e}")
    assert math.isfinite(err) and err <= tol, (err, tol)
    assert lse_err <= max(tol, 1e-3), lse_err
    assert not cache._counters.any(), "the last CTA of every (sequence, KV head) resets its counter"
    for launch in range(repeats):
        poison_attend_buffers(cache, len(order), q, rotate)
        again, again_lse = cache.attend(1, order, q, sm_scale=sm_scale, return_lse=True)
        assert torch.equal(again, out) and torch.equal(again_lse, lse), f"launch {launch + 2} differs from the first"


@pytest.mark.parametrize("case", [0, 1, len(CASES) - 1], ids=lambda i: CASES[i][0].name)
@pytest.mark.parametrize("budget", [None, 1])
def test_empty_sequences_attend_to_the_empty_softmax(case, budget, rng):
    """Allocated sequences with no token yet, among sequences with tokens (and a batch of them alone):
    out exactly 0 and lse -inf, the others against float64; one launch (the work list, any budget)
    and the two-launch variant (the last case)."""
    scheme, page_size, max_len, kv_heads, rotate = CASES[case]
    cache = PagedKVCache(scheme, 1, kv_heads, num_pages=64, max_seqs=6, max_seq_len=max_len, page_size=page_size,
                         sink=SINK, window=WINDOW, rotate=rotate, device="cuda")
    if budget is not None:
        cache.cta_budget = budget
    d, dtype = scheme.head_dim, scheme.q_dtype
    ids = [cache.allocate() for _ in range(5)]
    for seq, n in ((ids[1], 3001), (ids[3], SINK + 5)):
        k = torch.randn(1, kv_heads, n, d, generator=rng) + 2 * torch.randn(d, generator=rng)
        cache.append(0, [seq], k.to("cuda", dtype), torch.randn(1, kv_heads, n, d, generator=rng).to("cuda", dtype))
    sm_scale = d**-0.5
    for order, empty in ((ids, (0, 2, 4)), ([ids[0], ids[2]], (0, 1)), ([ids[4]], (0,))):
        q = torch.randn(len(order), kv_heads * scheme.gqa_ratio, d, generator=rng).to("cuda", dtype)
        poison_attend_buffers(cache, len(order), q, rotate)
        out, lse = cache.attend(0, order, q, sm_scale=sm_scale, return_lse=True)
        torch.cuda.synchronize()
        for b in range(len(order)):
            if b in empty:
                assert torch.equal(out[b], torch.zeros_like(out[b])), out[b]
                assert torch.equal(lse[b], torch.full_like(lse[b], -math.inf)), lse[b]
            else:
                ref, ref_lse, low = reference(cache, 0, [order[b]], q[b:b + 1], sm_scale, dtype)
                tol = 2 * float((low.double() - ref).abs().max()) + FLOOR
                assert float((out[b:b + 1].double() - ref).abs().max()) <= tol
                assert float((lse[b:b + 1].double() - ref_lse).abs().max()) <= max(tol, 1e-3)
        assert not cache._counters.any()


@pytest.mark.parametrize("case", [0, 8, 14], ids=lambda i: CASES[i][0].name)
def test_window_kernel_matches_float64(case, rng):
    """``foscar.kernels.sink_window`` -- the Hopper cache decode's second launch where the window tiles do not
    fit its ring (the last case) -- on this GPU: sequences held entirely in the 16-bit slots (no packed part),
    the decode launch's partial given as empty, against float64 over the cache."""
    from foscar.kernels.sink_window import sink_window_attend, window_ctas

    scheme, page_size, _, kv_heads, _ = CASES[case]
    cache = PagedKVCache(scheme, 1, kv_heads, num_pages=8, max_seqs=5, max_seq_len=4096, page_size=page_size,
                         sink=SINK, window=WINDOW, device="cuda")
    d, dtype = scheme.head_dim, scheme.q_dtype
    lengths = [1, SINK - 3, SINK + 100, SINK + WINDOW]  # none reaches the packed pages
    ids = [cache.allocate() for _ in lengths][::-1]
    for seq, n in zip(ids[::-1], lengths):
        k = torch.randn(1, kv_heads, n, d, generator=rng) + 2 * torch.randn(d, generator=rng)
        v = torch.randn(1, kv_heads, n, d, generator=rng)
        cache.append(0, [seq], k.to("cuda", dtype), v.to("cuda", dtype))
    assert all(cache.quantized_tokens(n) == 0 for n in lengths)
    batch, hq = len(ids), kv_heads * scheme.gqa_ratio
    q = torch.randn(batch, hq, d, generator=rng).to("cuda", dtype)
    total = 1 + window_ctas(cache.k_bf16.shape[3])
    o_part = torch.full((batch, hq, total, d), float("nan"), device="cuda")
    o_part[:, :, 0] = 0.0
    lse_part = torch.full((batch, hq, total), float("nan"), device="cuda")
    lse_part[:, :, 0] = -math.inf  # the decode's split: empty
    out = torch.full((batch, hq, d), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((batch, hq), float("nan"), device="cuda")
    sm_scale = 0.7 * d**-0.5
    rows = torch.tensor(ids, dtype=torch.int64, device="cuda")
    sink_window_attend(q, cache.k_bf16[0], cache.v_bf16[0], rows, cache.lengths[0], o_part, lse_part, out, lse,
                       cache._counters, 1, SINK, WINDOW, cache.granule, sm_scale, cache.arch.name)
    torch.cuda.synchronize()
    ref, ref_lse, low = reference(cache, 0, ids, q, sm_scale, dtype)
    tol = 2 * float((low.double() - ref).abs().max()) + FLOOR
    err = float((out.double() - ref).abs().max())
    assert math.isfinite(err) and err <= tol, (err, tol)
    assert float((lse.double() - ref_lse).abs().max()) <= max(tol, 1e-3)
    assert not cache._counters.any()


@pytest.mark.parametrize("lengths, budget", [([1, 70, SINK + WINDOW + 200, 3001, 9000, 700, 16000], 20),
                                             ([SINK + WINDOW + 66 * 256 + 500], 132),
                                             ([9000, 9000, 9000, 4000, 9000], 8)], ids=["ragged", "one-round", "waves"])
def test_device_plan_is_the_host_plan(lengths, budget, monkeypatch, rng):
    """The work list as the Hopper launch plans it on the GPU (foscar.work_list.WorkList.find) is
    ``foscar.work_list.host_plan``, the CPU mirror that the Blackwell cache decode's plan (the same WorkList and
    CacheWork) is checked with (tests/test_blackwell_cache.py): the item partials the launch writes are exactly
    those of the (sequence, KV head)s the host plan cuts into several parts, and the output matches float64.
    Ragged: some sequences in one part, some in several; one round: a sequence alone whose 66 parts per KV head
    (132 / 2) the plan cuts to ONE_ROUND_PARTS (foscar.work_list.one_round_parts); waves: 10 pairs on a budget of
    8, which ``wave_budget`` cuts into parts over whole waves (the 9000-token sequences in P = 2 parts, the
    4000-token one in 1)."""
    import foscar.launch
    from foscar.work_list import ONE_ROUND_PARTS, host_plan

    scheme, page_size, kv_heads = Scheme.make(2, "token", 128, "token", 128, 128, 4), 128, 2
    # (a pool of 64 pages to spare: its mean over the batch stays past SHORT_CONTEXT_TOKENS, one CTA per SM)
    cache = PagedKVCache(scheme, 1, kv_heads, num_pages=sum(-(-n // page_size) for n in lengths) + 64,
                         max_seqs=len(lengths), max_seq_len=-(-max(lengths) // page_size) * page_size,
                         page_size=page_size, sink=SINK, window=WINDOW, device="cuda")
    cache.cta_budget = budget
    ids = [cache.allocate() for _ in lengths]
    d, dtype = scheme.head_dim, scheme.q_dtype
    for seq, n in zip(ids, lengths):
        k = torch.randn(1, kv_heads, n, d, generator=rng) + 2 * torch.randn(d, generator=rng)
        cache.append(0, [seq], k.to("cuda", dtype), torch.randn(1, kv_heads, n, d, generator=rng).to("cuda", dtype))
    partials = {}
    launch_args = foscar.launch._launch_args

    def poisoned(names, q_type, values):  # the launch's partials, NaN before it runs
        for name in ("o_part", "lse_part"):
            values[name].fill_(math.nan)
            partials[name] = values[name]
        return launch_args(names, q_type, values)

    monkeypatch.setattr(foscar.launch, "_launch_args", poisoned)
    order = ids[::-1]
    q = torch.randn(len(order), kv_heads * scheme.gqa_ratio, d, generator=rng).to("cuda", dtype)
    out, lse = cache.attend(0, order, q, sm_scale=d**-0.5, return_lse=True)
    torch.cuda.synchronize()
    written = {x for x in range(partials["lse_part"].shape[0]) if not partials["lse_part"][x].isnan().all()}
    kernels = cache.arch._kernels()
    work = kernels.cache_kernel(kernels.cache_config(scheme, page_size, 1, *kernels.options(scheme, 1))).cache_work
    ring = cache.k_bf16[0].shape[2] - SINK
    works, caps = zip(*(work.host_sequence(lengths[ids.index(s)], SINK, WINDOW, ring) for s in order))
    planned_budget = launch_budget(cache, lengths)
    assert (planned_budget > budget) == (len(lengths) * kv_heads > budget)  # past one wave: whole waves of parts
    items = host_plan(works, caps, kv_heads, planned_budget)
    assert written == {x for x, (_b, _h, _part, parts) in enumerate(items) if parts > 1}
    planned = {parts for *_, parts in items}
    if len(lengths) == 1:
        assert planned == {ONE_ROUND_PARTS}
    elif planned_budget > budget:  # (the order is reversed: the 4000-token sequence is second)
        counts = [parts for _b, _h, part, parts in items if part == 0]
        assert counts == [2] * kv_heads + [1] * kv_heads + [2] * 3 * kv_heads
    else:
        assert 1 in planned and max(planned) > 1
    ref, ref_lse, low = reference(cache, 0, order, q, d**-0.5, dtype)
    tol = 2 * float((low.double() - ref).abs().max()) + FLOOR
    assert float((out.double() - ref).abs().max()) <= tol
    assert not cache._counters.any()

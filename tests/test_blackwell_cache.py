"""The Blackwell cache decode (foscar.blackwell.cache_decode) is Hopper's serving path by construction: one
launch over the same work list, the same window share per work item and the same in-launch merge. No
Blackwell GPU exists here, so it is checked on the CPU: its host plan against Hopper's, the plan and merge
emulated in float64 against dense attention, and its compiled sm_100a code (one kernel with the window's
mma.sync, the merge's atomics, no spills)."""

import math
import re

import numpy as np
import pytest
import torch

pytest.importorskip("cutlass")

from foscar.archs import BLACKWELL, HOPPER  # noqa: E402
from foscar.layouts.fragment import TILE_TOKENS  # noqa: E402
from foscar.pipeline import split_range  # noqa: E402
from foscar.scheme import Scheme  # noqa: E402
from foscar.window_tiles import BLOCK, window_blocks  # noqa: E402
from foscar.work_list import (GROUP, MAX_SPLITS, ONE_ROUND_PARTS, CacheWork, grid_ctas, host_plan,  # noqa: E402
                              MAX_BUDGET, one_round_parts, wave_budget)

SCHEMES = [  # (scheme, page_size): both bit widths and axes, head_dim 64/128/256, FP16 and BF16, mixed bits
    (Scheme.make(2, "token", 128, "token", 128, 128, 4), 128),
    (Scheme.make(2, "channel", 128, "token", 128, 128, 4), 128),
    (Scheme.make(4, "token", 128, "channel", 128, 128, 16, torch.float16), 128),
    (Scheme.make(4, "channel", 64, "channel", 64, 64, 8), 64),
    (Scheme.make(2, "token", 64, "token", 64, 64, 1), 64),
    (Scheme.make(2, "channel", 256, "token", 128, 256, 8), 256),  # Hopper's two-launch config: one launch here
    (Scheme.make(4, "token", 128, "channel", 128, 256, 2, torch.float16), 256),
    (Scheme.make(None, "token", 64, "token", 64, 64, 8, k_bits=4, v_bits=2), 128),
    (Scheme.make(4, "token", 256, "token", 256, 256, 7), 64),  # the preparation loop at its register ceiling
]
IDS = [f"{s.name}-p{p}" for s, p in SCHEMES]


def _cache_work(arch, scheme, page_size) -> CacheWork:
    kernels = arch._kernels()
    cfg = kernels.cache_config(scheme, page_size, 1, *kernels.options(scheme, 1))
    return kernels.cache_kernel(cfg).cache_work


@pytest.mark.parametrize("scheme, page_size", SCHEMES, ids=IDS)
def test_host_plan_and_buffers_are_hopper_s(scheme, page_size):
    """The same per-sequence work (packed tile bytes, window block bytes, cap, granule) on both arches, so one
    batch gets one plan; the same partial buffers and launch values from the cache (the Hopper launch's
    ``num_splits`` and ``parts`` serve only its two-launch configs)."""
    hopper, blackwell = _cache_work(HOPPER, scheme, page_size), _cache_work(BLACKWELL, scheme, page_size)
    assert vars(hopper) == vars(blackwell)
    kernels = {arch: arch._kernels() for arch in (HOPPER, BLACKWELL)}
    assert kernels[BLACKWELL].fuses_window(scheme, page_size)
    for batch, kv_heads, budget in ((1, 1, 132), (7, 4, 132), (64, 8, 148)):
        shapes = {arch: k.cache_partials(scheme, page_size, batch, kv_heads, 4, budget, 448)
                  for arch, k in kernels.items()}
        assert shapes[BLACKWELL] == (grid_ctas(budget, batch, kv_heads), scheme.gqa_ratio, scheme.head_dim)
        if kernels[HOPPER].fuses_window(scheme, page_size, *kernels[HOPPER].options(scheme, 1)):
            assert shapes[HOPPER] == shapes[BLACKWELL]
    # one entry for both arches' cache decodes (foscar.decode_kernel.CacheDecodeBase)
    assert kernels[HOPPER].cache_kernel.__call__ is kernels[BLACKWELL].cache_kernel.__call__


def _lengths(rng, batch):
    return [int(x) for x in rng.integers(1, 20000, batch)]


@pytest.mark.parametrize("batch, kv_heads, budget", [(1, 8, 132), (5, 2, 132), (40, 8, 132), (200, 1, 16)])
def test_host_plan_covers_every_sequence_within_the_grid(batch, kv_heads, budget):
    """foscar.work_list.host_plan (the CPU mirror of WorkList.find): every (sequence, KV head) gets consecutive
    items, part 0 .. parts - 1, parts within [1, min(cap, MAX_SPLITS)], all within the launch's grid."""
    rng = np.random.default_rng(batch)
    work = CacheWork(4608, 128, 128)
    lengths = _lengths(rng, batch)
    works, caps = zip(*(work.host_sequence(n, 64, 256, 320) for n in lengths))
    items = host_plan(works, caps, kv_heads, budget)
    assert len(items) <= grid_ctas(budget, batch, kv_heads)
    x = 0
    for b in range(batch):
        for h in range(kv_heads):
            parts = items[x][3]
            assert 1 <= parts <= min(caps[b], MAX_SPLITS)
            assert items[x:x + parts] == [(b, h, part, parts) for part in range(parts)]
            x += parts
    assert x == len(items)


@pytest.mark.parametrize("kv_heads, budget, parts", [(2, 132, ONE_ROUND_PARTS), (1, 132, MAX_SPLITS),
                                                     (1, ONE_ROUND_PARTS + GROUP, ONE_ROUND_PARTS + GROUP),
                                                     (1, ONE_ROUND_PARTS + 1, ONE_ROUND_PARTS), (4, 132, 33)])
def test_host_plan_keeps_the_last_merge_to_one_round(kv_heads, budget, parts):
    """A long sequence alone: budget / kv_heads parts per KV head, except a count less than a merge group past
    ONE_ROUND_PARTS, cut to it (tp4-70b's 2 KV heads on 132 SMs: 64 parts, not 66, whose ninth group would cost the
    last merge a second round of loads: ONE_ROUND_PARTS is GROUP x split_merge.BATCH)."""
    from foscar.split_merge import BATCH

    assert ONE_ROUND_PARTS == GROUP * BATCH
    work = CacheWork(4608, 128, 128)
    items = host_plan(*zip(work.host_sequence(131072, 64, 256, 320)), kv_heads, budget)
    assert {p for *_, p in items} == {parts} and len(items) == kv_heads * parts
    assert [one_round_parts(p) for p in (1, 64, 65, 71, 72, 128)] == [1, 64, 64, 64, 72, 128]


@pytest.mark.parametrize("sequences", [20, 36, 55, 60])
def test_past_one_wave_the_budget_cuts_pairs_into_whole_waves(sequences):
    """Serving at 100K-token prefixes (8 KV heads, 132 SMs): every pair in one part made ceil(pairs / 132) rounds of
    a whole sequence each (440 pairs: 3.3 waves of work in 4 rounds); ``wave_budget`` gives the work list ``P x pairs
    + pairs // 2``, so each pair of an equal-length batch, and of one whose lengths are a little apart, takes P parts
    and the rounds of whole-sequence work fall (plan_splits' cost model), the items within the launch's grid; a
    sequence of half the mean length takes fewer. Within one wave, many waves of short sequences, or with
    the mean not known the budget is as given."""
    kv_heads, budget, packed = 8, 132, 100096
    pairs = sequences * kv_heads
    planned = wave_budget(budget, pairs, packed)
    parts = planned // pairs
    assert planned == parts * pairs + pairs // 2 and parts > 1
    assert math.ceil(pairs * parts / budget) / parts < math.ceil(pairs / budget)  # rounds of a whole sequence
    work = CacheWork(4608, 128, 128)
    ragged = [packed + 64 * (i % 16) - 512 for i in range(sequences)]  # 100K +- 512 tokens
    for lengths in ([packed] * sequences, ragged, [packed] * (sequences - 1) + [packed // 2]):
        items = host_plan(*zip(*(work.host_sequence(n + 320, 64, 256, 320) for n in lengths)), kv_heads, planned)
        counts = [p for b, _h, part, p in items if part == 0]  # per pair, in sequence order
        assert set(counts[:-kv_heads]) == {parts} and len(items) <= grid_ctas(planned, sequences, kv_heads)
        assert (counts[-1] == parts) == (lengths[-1] > packed // 2)  # the half-length sequence: fewer
    assert wave_budget(budget, 8 * kv_heads, packed) == budget  # one wave
    assert wave_budget(2 * budget, 256 * kv_heads, 2048) == 2 * budget  # 256 x 2K: 8 waves, one part each
    assert wave_budget(budget, pairs, 0) == budget
    assert wave_budget(20000, 20001, packed) == MAX_BUDGET  # (P ~ 30 parts of 20001 pairs, clamped)


def _slot_position(j, n, qlen, sink, ring):
    """The window slot ``j``'s token position, or None (foscar.window_tiles.slot_holds_token, slot_position)."""
    if j < sink:
        return j if j < n else None
    rel = (j - sink - qlen) % ring
    return sink + qlen + rel if rel < max(n - sink - qlen, 0) else None


def _attend(scores, values):
    """(O unnormalized, m, l) in the log2 domain (foscar.softmax conventions) of scores [T, R], values [T, D]."""
    if len(scores) == 0:
        rows = scores.shape[1]
        return np.zeros((rows, values.shape[1])), np.full(rows, -np.inf), np.zeros(rows)
    m = scores.max(0)
    p = np.exp2(scores - m)
    return p.T @ values, m, p.sum(0)


def _merge_in_cta(packed, window):
    """BlackwellCacheDecodeKernel.epilogue: the packed result normalized with its lse (the decode's epilogue), then
    merged with the window's unnormalized (O, m, l) (merge_weights, store_element): the item's partial and lse."""
    (o_p, m_p, l_p), (o_w, m_w, l_w) = packed, window
    with np.errstate(divide="ignore", invalid="ignore"):
        lse_p = np.where(l_p > 0, (m_p + np.log2(l_p)) * math.log(2), -np.inf)
        o_p = np.where(l_p[:, None] > 0, o_p / l_p[:, None], 0.0)
        a, b = lse_p * math.log2(math.e), m_w + np.log2(l_w)  # -inf where a part saw nothing
        ref = np.maximum(a, b)
        ref = np.where(np.isinf(ref), 0.0, ref)
        total = np.exp2(a - ref) + np.exp2(b - ref)
        inv = np.where(total > 0, 1 / total, 0.0)
        lse = np.where(total > 0, (ref + np.log2(total)) * math.log(2), -np.inf)
    return o_p * (np.exp2(a - ref) * inv)[:, None] + o_w * (np.exp2(m_w - ref) * inv)[:, None], lse


# ring: window + granule, more with rollback room (foscar.cache.PagedKVCache)
@pytest.mark.parametrize("sink, window, ring, granule", [(64, 256, 384, 128), (4, 128, 192, 64), (0, 256, 512, 256),
                                                         (16, 128, 256, 64)])
def test_plan_window_share_and_merge_emulated_match_attention(sink, window, ring, granule):
    """Float64 emulation of the one-launch decode (both arches' plan and window share; Blackwell's in-CTA merge):
    each item attends its part's packed 128-token steps (TileSpan.of_split) and window blocks part, part + parts,
    ... (window_blocks); its (O, m, l) pairs merge as the epilogue merges them, the parts as foscar.split_merge
    does. Every token of every sequence is attended exactly once and the result is dense attention's."""
    rng = np.random.default_rng(sink + window)
    batch, kv_heads, budget, R, D = 6, 2, 20, 3, 16
    lengths = [1, 5, sink + window + 1, 700, 3000, 9000]
    work = CacheWork(4608, D, granule)
    works, caps = zip(*(work.host_sequence(n, sink, window, ring) for n in lengths))
    items = host_plan(works, caps, kv_heads, budget)
    parts_of = {}
    for b, h, part, parts in items:
        n = lengths[b]
        qlen = max(n - sink - window, 0) // granule * granule
        k, v = rng.standard_normal((n, D)), rng.standard_normal((n, D))
        k, v = parts_of.setdefault((b, h, "kv"), (k, v))
        q = parts_of.setdefault((b, h, "q"), rng.standard_normal((R, D)))
        _tiles, begin, end = split_range(qlen, part, parts, 2)  # whole 128-token steps
        packed = list(range(sink + begin * TILE_TOKENS, sink + min(end * TILE_TOKENS, qlen)))
        blocks = window_blocks(sink + ring, part, parts)
        slots = [BLOCK * (part + parts * i) + r for i in range(blocks) for r in range(BLOCK)]
        held = [p for p in (_slot_position(j, n, qlen, sink, ring) for j in slots if j < sink + ring) if p is not None]
        parts_of.setdefault((b, h), []).append((packed, held))
        pieces = [_attend(k[pos] @ q.T * 0.25, v[pos]) for pos in (np.array(packed, int), np.array(held, int))]
        parts_of.setdefault((b, h, "out"), []).append(_merge_in_cta(*pieces))
    for b in range(batch):
        for h in range(kv_heads):
            seen = sorted(p for packed, held in parts_of[(b, h)] for p in packed + held)
            assert seen == list(range(lengths[b])), (b, h)  # each token once
            o_s, lse_s = map(np.array, zip(*parts_of[(b, h, "out")]))  # [parts, R, D], [parts, R]
            m = lse_s.max(0)
            w = np.exp(lse_s - m)
            out = (w[:, :, None] * o_s).sum(0) / w.sum(0)[:, None]  # foscar.split_merge
            (k, v), q = parts_of[(b, h, "kv")], parts_of[(b, h, "q")]
            s = k @ q.T * 0.25 * math.log(2)  # natural log of the log2-domain scores
            p = np.exp(s - s.max(0))
            np.testing.assert_allclose(out, p.T @ v / p.sum(0)[:, None], rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(m + np.log(w.sum(0)), np.log(np.exp(s - s.max(0)).sum(0)) + s.max(0), rtol=1e-10)


@pytest.mark.sass
@pytest.mark.parametrize("scheme, page_size", SCHEMES, ids=IDS)
def test_compiles_for_sm100a_as_one_launch(scheme, page_size):
    """One kernel: the decode CTA's tcgen05 roles (the split-output decode's MMAs, bulk copies, commits), the
    window blocks' mma.sync in the window's 16-bit type with cp.async rows, the work list's scans, the prep ->
    output handoff (bar.arrive), the merge's counting atomics; no spills."""
    from foscar.inspect import artifacts, parse_instructions, role_loops

    cache = artifacts(BLACKWELL.compile_cache_decode(scheme, page_size))
    decode = artifacts(BLACKWELL.compile_decode(scheme, page_size, partial_output=True))
    assert len(re.findall(r"^\.(visible )?\.entry ", cache.ptx, re.MULTILINE)) == 1
    for pattern in (r"tcgen05\.mma\.cta_group::1\.kind::f8f6f4", r"cp\.async\.bulk\.shared::cluster",
                    r"tcgen05\.commit", r"setmaxnreg\.(inc|dec)"):
        assert len(re.findall(pattern, cache.ptx)) == len(re.findall(pattern, decode.ptx)) > 0, pattern
    half = "bf16" if scheme.q_dtype == torch.bfloat16 else "f16"
    assert re.search(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{half}\.{half}\.f32", cache.ptx)
    assert "mma.sync" not in decode.ptx
    assert "cp.async.cg.shared.global" in cache.ptx and "movmatrix.sync.aligned.m8n8.trans.b16" in cache.ptx
    assert cache.ptx.count("shfl.sync.up.b32") >= 10  # the work list: two block-wide scans of 5 steps
    assert "bar.arrive 6, 256" in cache.ptx  # the window's (O, m, l) handed to the output warpgroup
    # SplitMerge.merge_items: the group's count and the (sequence, KV head)'s (foscar.split_merge)
    assert len(re.findall(r"atom\.global\.acq_rel\.add\.u32", cache.ptx)) == 2
    # at most one CTA-constant word spilled (16 query columns: the softmax and output warpgroups at their ceilings),
    # reloaded per role and per window block, never in the packed steps' loops
    assert cache.resources().local_bytes <= 8
    sass = cache.sass_by_kernel[cache.kernel()]
    instructions, _ = parse_instructions(sass)
    for loop in role_loops(sass):
        body = {i.base for i in instructions if loop.start <= i.address <= loop.end}
        assert loop.local_accesses == 0 or "HMMA" in body, loop  # only the window blocks' loop may reload it


def test_query_tokens_leave_room_for_the_window():
    """Where several query tokens' columns leave no shared memory for the window blocks, a Blackwell launch takes
    fewer tokens (the cache runs more launches), stated before anything compiles; elsewhere the query tile's
    limit stands, as on Hopper."""
    tight = Scheme.make(k="token", k_group=64, v="token", v_group=32, head_dim=256, gqa_ratio=7, k_bits=4, v_bits=4)
    assert BLACKWELL.max_query_tokens(tight) == (1, ("a query tile holds 16 columns per KV head: gqa_ratio=7 x tokens; "
                                                     "2 leave no shared memory for the cache decode's window blocks"))
    with pytest.raises(ValueError, match="q: 2 query tokens .* takes 1..1 .*window blocks"):
        BLACKWELL.compile_cache_decode(tight, 128, tokens=2)
    for scheme, _page_size in SCHEMES:
        assert BLACKWELL.max_query_tokens(scheme) == HOPPER.max_query_tokens(scheme), scheme.name

"""``decode_paged`` / ``decode`` with several query tokens per sequence (speculative verification over a cache
whose pages hold every token, the draft's included): each token attends its sequence up to itself. The packed
tiles carry the causal mask (``QueryRows.row_bound``); past one launch's ``16 // gqa`` tokens the earlier tokens
run as launches over the sequences cut short. GPU tests compare every element against float64 causal attention of
the dequantized cache (fresh random inputs, NaN-poisoned outputs, the project's tolerance rule)."""

import itertools

import pytest
import torch

from foscar import Scheme
from foscar.archs import BLACKWELL, HOPPER
from foscar.decode import compile_decode, decode, validate_paged
from foscar.query_rows import QueryRows
from foscar.scheme import Axis
from foscar.testing import random_problem
from test_cache_chunk import assert_within_the_rule

INT2_KT = Scheme.make(2, "token", 128, "token", 128, 128, 4)
INT4_KC = Scheme.make(4, "channel", 128, "token", 128, 128, 2)


@pytest.mark.parametrize("gqa, tokens", [(1, 16), (4, 4), (2, 3), (16, 1), (3, 5)])
def test_row_bound_is_the_causal_mask_shifted_to_a_tile(gqa, tokens):
    """Column ``col`` keeps tile row ``r`` (of a tile whose first ``valid`` rows precede the end) iff it sees
    that token, for every real column; a padding column keeps the valid rows."""
    rows = QueryRows(gqa, tokens)
    for n, tile_start in itertools.product(range(tokens, 200, 7), range(0, 200, 64)):
        valid = n - tile_start
        if valid < 1:
            continue
        for col, r in itertools.product(range(16), range(64)):
            kept = r < rows.row_bound(col, valid)
            if col < rows.R:
                assert kept == (r < valid and rows.sees(col, tile_start + r, n)), (n, tile_start, col, r)
            else:
                assert kept == (r < valid)


def test_validation_takes_4d_q_and_names_lengths_shorter_than_the_tokens():
    q, cache = random_problem(INT2_KT, [70, 3], kv_heads=2, page_size=128, device="cpu")
    q4 = torch.stack([q, q, q], dim=1)  # [batch, 3 tokens, Hq, D]
    args = (cache.k_codes, cache.k_params, cache.v_codes, cache.v_params, cache.page_table)
    validate_paged(q4, *args, cache.lengths, INT2_KT, 128, None)
    with pytest.raises(ValueError, match=r"lengths must lie in \[4 "):
        validate_paged(torch.stack([q] * 4, dim=1), *args, cache.lengths, INT2_KT, 128, None)
    with pytest.raises(ValueError, match="q must have shape"):
        validate_paged(q4[None], *args, cache.lengths, INT2_KT, 128, None)
    with pytest.raises(ValueError, match="q must hold"):
        validate_paged(q4[:, :0], *args, cache.lengths, INT2_KT, 128, None)


@pytest.mark.parametrize("arch", [HOPPER, BLACKWELL], ids=lambda a: a.name)
@pytest.mark.parametrize("scheme, tokens", [(INT2_KT, 4), (INT4_KC, 3), (INT4_KC, 8)], ids=str)
def test_decode_of_several_tokens_compiles(arch, scheme, tokens):
    art = compile_decode(scheme, arch.name, 128, True, tokens)
    if arch is HOPPER and scheme.gqa_ratio * tokens > 8:
        # Hopper at 16 columns: channel-wise K spills a little, as in the cache decode (benchmarks/NOTES.md section
        # 20); token-wise K reloads a few loop-invariant words per tile since the V fold of section 30 (7 LDL.64
        # where the loop lost 75 instructions), and stores nothing in its loop
        loop = art.loop_mix()
        assert scheme.k.axis is Axis.CHANNEL or (loop["LDL"] <= 8 and loop["STL"] == 0), loop
    else:
        assert art.resources().local_bytes == 0, art.resources()


def test_one_launch_refuses_more_tokens_than_a_query_tile_holds():
    with pytest.raises(ValueError, match=r"q: 5 query tokens per sequence: the sm_90a decode takes 1\.\.4"):
        compile_decode(INT2_KT, "sm_90a", 128, True, 5)


# ---------------------------------------------------------------------------------------------------------------- GPU
GPU_CASES = [  # scheme, lengths, tokens, num_splits
    (INT2_KT, [65, 700, 4], 4, None),  # 65: token 0 sees nothing of the second tile; 4: every token sees itself first
    (INT2_KT, [129, 1000], 4, 3),  # the last split holds one tile, where some columns see no token
    (INT2_KT, [300, 68, 2000], 8, 2),  # two launches of 4 tokens; 68: the earlier launch's sequence ends a tile
    (INT4_KC, [1100, 17], 8, None),  # gqa 2: 16 columns in one launch
    (INT2_KT, [500, 1], 1, 3),  # a 4-d q of one token: the single-token kernel
    (INT4_KC, [513, 31], 16, 64),  # two launches; empty splits
    (Scheme.make(2, "channel", 128, "channel", 128, 64, 1, torch.float16), [257, 20], 16, 5),  # gqa 1
]


@pytest.mark.gpu
@pytest.mark.parametrize("scheme, lengths, tokens, num_splits", GPU_CASES, ids=str)
def test_decode_of_several_tokens_matches_float64(scheme, lengths, tokens, num_splits, rng):
    q, cache = random_problem(scheme, lengths, kv_heads=2, page_size=128, generator=rng)  # replayable: rng's seed
    q = torch.randn(len(lengths), tokens, *q.shape[1:], generator=rng).to("cuda", q.dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:-1], float("nan"), device="cuda")
    decode(q, cache, return_lse=True, num_splits=num_splits, out=out, lse=lse)
    k, v = cache.dequantize(torch.float64)
    sm_scale = scheme.head_dim**-0.5
    for b, n in enumerate(lengths):
        assert_within_the_rule(out[b], lse[b], q[b].cpu(), k[b, :, :n].cpu(), v[b, :, :n].cpu(), sm_scale,
                               (scheme.name, lengths, tokens, b))


@pytest.mark.gpu
def test_decode_of_several_tokens_in_a_cuda_graph_equals_eager():
    q, cache = random_problem(INT2_KT, [900, 77], kv_heads=2, page_size=128)
    q = torch.randn(2, 8, *q.shape[1:], device="cuda").to(q.dtype)  # two launches
    eager = decode(q, cache, num_splits=2)
    out = torch.full_like(q, float("nan"))
    graph = torch.cuda.CUDAGraph()
    decode(q, cache, num_splits=2, out=out)  # compile outside the capture
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        decode(q, cache, num_splits=2, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)

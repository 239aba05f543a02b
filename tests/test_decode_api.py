"""The public decode API rejects bad input with errors naming the argument (CPU: before any kernel)."""

import pytest
import torch

from foscar import Scheme, quantize_kv
from foscar.decode import MAX_DECODE_SPLITS, decode, decode_paged, plan_splits, validate_paged


@pytest.fixture
def case(rng):
    scheme = Scheme.make(2, k="channel", k_group=64, gqa_ratio=4)
    k = torch.randn(2, 2, 130, 128, generator=rng).bfloat16()
    cache = quantize_kv(k, k.clone(), scheme, 64, torch.tensor([130, 7], dtype=torch.int32))
    q = torch.randn(2, 8, 128, generator=rng).bfloat16()
    args = dict(q=q, k_codes=cache.k_codes, k_params=cache.k_params, v_codes=cache.v_codes, v_params=cache.v_params,
                page_table=cache.page_table, lengths=cache.lengths, scheme=scheme, page_size=64)
    return cache, args


def _call(args, **change):
    a = dict(args)
    a.update(change)
    return decode_paged(**a)


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (lambda a: dict(q=a["q"].float()), TypeError, "q must have dtype"),
        (lambda a: dict(q=a["q"][:, :6].contiguous()), ValueError, "kv_heads"),
        (lambda a: dict(q=a["q"][..., :64]), ValueError, "head_dim"),
        (lambda a: dict(q=a["q"].transpose(0, 1).contiguous().transpose(0, 1)), ValueError, "q must be contiguous"),
        (lambda a: dict(k_codes=a["k_codes"].long()), TypeError, "k_codes must have dtype"),
        (lambda a: dict(v_codes=a["v_codes"][:, :, :, :100]), ValueError, "v_codes must have shape"),
        (lambda a: dict(k_params=a["k_params"].float()), TypeError, "k_params must have dtype"),
        (lambda a: dict(v_params=a["v_params"][..., :1]), ValueError, "v_params must have shape"),
        (lambda a: dict(page_table=a["page_table"].long()), TypeError, "page_table must have dtype"),
        (lambda a: dict(page_table=a["page_table"] + 100), ValueError, "page_table holds page indices outside"),
        (lambda a: dict(page_table=a["page_table"] - 1), ValueError, "page_table holds page indices outside"),
        (lambda a: dict(lengths=a["lengths"][:1]), ValueError, "lengths must have shape"),
        (lambda a: dict(lengths=a["lengths"] * 0), ValueError, "lengths must lie"),
        (lambda a: dict(lengths=a["lengths"] + 1000), ValueError, "lengths must lie"),
        (lambda a: dict(page_size=32), ValueError, "page_size must be one of"),
        (lambda a: dict(page_size=64.0), ValueError, "page_size must be one of"),
        (lambda a: dict(q=a["q"][:0], page_table=a["page_table"][:0], lengths=a["lengths"][:0]), ValueError,
         "q must hold at least one sequence"),
        (lambda a: dict(q=a["q"].to("meta")), ValueError, "q is a meta tensor"),
        (lambda a: dict(scheme="int2"), TypeError, "scheme must be"),
        (lambda a: dict(scheme=Scheme.make(4, gqa_ratio=4)), ValueError, "k_codes must have shape"),
        (lambda a: dict(sm_scale=float("nan")), ValueError, "sm_scale"),
        (lambda a: dict(q=None), TypeError, "q must be a torch.Tensor"),
        (lambda a: dict(layout="ampere"), ValueError, "layout must be"),
        (lambda a: dict(out=torch.empty_like(a["q"])[:, :4]), ValueError, "out must have shape"),
        (lambda a: dict(out=torch.empty_like(a["q"]).float()), TypeError, "out must have dtype"),
        (lambda a: dict(lse=torch.empty(a["q"].shape, dtype=torch.float32)), ValueError, "lse must have shape"),
        (lambda a: dict(q=torch.stack([a["q"]] * 2, 1), out=torch.empty_like(a["q"])), ValueError,
         "out must have shape"),  # a 4-d q: out takes its shape
        (lambda a: dict(q=torch.stack([a["q"]] * 2, 1), lse=torch.empty(a["q"].shape[:-1])), ValueError,
         "lse must have shape"),
    ],
)
def test_bad_arguments_are_named(case, change, exc, match):
    _, args = case
    with pytest.raises(exc, match=match):
        _call(args, **change(args))


def test_page_index_beyond_a_sequence_length_is_not_checked(case):
    """Unused page-table slots (past the length) may hold anything, as in serving engines."""
    _, args = case
    table = args["page_table"].clone()
    table[1, 2] = 10_000  # sequence 1 has 7 tokens: page 2 is unused
    with pytest.raises(ValueError, match="must be a CUDA tensor"):  # validation passed; no GPU here
        _call(args, page_table=table)


def test_decode_checks_the_cache_type(case):
    cache, args = case
    with pytest.raises(TypeError, match="cache must be"):
        decode(args["q"], "cache")
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        decode(args["q"], cache)


def test_split_planning():
    from foscar.decode import MAX_DECODE_SPLITS, MIN_TOKENS_PER_SPLIT
    from foscar.work_list import WINDOW_MERGE_SPLITS

    few = plan_splits(1, 8, 32768, 132)  # 8 CTAs on 132 SMs: must split
    assert 4 <= few <= MAX_DECODE_SPLITS and 32768 / few >= MIN_TOKENS_PER_SPLIT
    assert plan_splits(128, 8, 8192, 132) == 1  # 1024 CTAs already fill the GPU
    assert plan_splits(1, 8, 300, 132) == 1  # too short to split
    assert plan_splits(1, 1, 1 << 20, 132) <= MAX_DECODE_SPLITS
    assert plan_splits(1, 8, 131072, 132) >= few  # longer context, at least as many splits
    assert plan_splits(1, 1, 131072, 132) == MAX_DECODE_SPLITS  # one KV head: 128 CTAs of 16 tiles
    # the two-launch cache decode's cap (PagedKVCache.num_splits): its window kernel merges every split in one CTA
    assert plan_splits(1, 1, 131072, 132, most=WINDOW_MERGE_SPLITS) == WINDOW_MERGE_SPLITS < MAX_DECODE_SPLITS
    # 66 splits of 2 x 2,048 tiles would be 64 of 32 tiles and 2 empty CTAs: the fewest with that longest split
    assert plan_splits(1, 2, 131072, 132) == 64
    with pytest.raises(ValueError, match="batch"):
        plan_splits(0, 8, 100, 132)


def test_compile_decode_checks_its_arguments():
    from foscar import compile_decode

    with pytest.raises(ValueError, match="arch must be one of"):
        compile_decode(Scheme.make(2), "sm_80")
    with pytest.raises(TypeError, match="scheme must be"):
        compile_decode("int2", "sm_90a")
    with pytest.raises(ValueError, match="page_size must be one of"):
        compile_decode(Scheme.make(2), "sm_90a", page_size=100)


def test_compile_decode_returns_inspectable_artifacts():
    from foscar import compile_decode

    art = compile_decode(Scheme.make(4, gqa_ratio=4), "sm_90a")
    loop = art.loop_mix()  # no local memory in the main loop (8 bytes outside it since benchmarks/NOTES.md section 30)
    assert "mma.sync.aligned.m16n8k16" in art.ptx and loop["LDL"] == loop["STL"] == 0, loop


def test_code_words_are_checked_per_tensor(rng):
    """A K4V2 cache passes validation (reaching the device check); its V pool in K's place is named."""
    scheme = Scheme.make(k_bits=4, v_bits=2, v="channel", v_group=64, gqa_ratio=2)
    k = torch.randn(1, 2, 130, 128, generator=rng).bfloat16()
    cache = quantize_kv(k, k.clone(), scheme, 64)
    assert cache.k_codes.shape[-1] == 2 * cache.v_codes.shape[-1]
    q = torch.randn(1, 4, 128, generator=rng).bfloat16()
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        decode(q, cache)
    with pytest.raises(ValueError, match="k_codes must have shape"):
        decode_paged(q, cache.v_codes, cache.k_params, cache.v_codes, cache.v_params, cache.page_table, cache.lengths,
                     scheme, 64)


def test_foscar_decode_called_is_the_decode_function(case, monkeypatch):
    """``foscar.decode`` is the module and, called, its ``decode``: the obvious call works, and
    ``from foscar.decode import ...`` / ``foscar.decode.decode_paged`` stay as they were."""
    import foscar
    import foscar.decode as module

    cache, args = case
    assert foscar.decode is module and module.decode is decode and foscar.decode.decode_paged is decode_paged
    seen = []
    monkeypatch.setattr(module, "decode_paged", lambda *a, **k: seen.append((a, k)) or "out")
    assert foscar.decode(args["q"], cache, return_lse=True) == "out"  # what decode(q, cache, ...) passes on
    assert seen[0][0][:2] == (args["q"], cache.k_codes) and seen[0][0][10] is True
    with pytest.raises(TypeError, match="cache must be a foscar.QuantizedKV, got NoneType"):
        foscar.decode(args["q"], None)


# ------------------------------------------------------------------ a helper's audit of bad input (session 28)
def _paged_case(batch=2, kv_heads=2, gqa=4):
    scheme = Scheme.make(2, k="channel", k_group=64, gqa_ratio=gqa)
    k = torch.randn(1, kv_heads, 64, 128).bfloat16()
    cache = quantize_kv(k, k.clone(), scheme, 64)
    return dict(q=torch.randn(batch, kv_heads * gqa, 128).bfloat16(), k_codes=cache.k_codes, k_params=cache.k_params,
                v_codes=cache.v_codes, v_params=cache.v_params, page_table=torch.zeros(batch, 1, dtype=torch.int32),
                lengths=torch.full((batch,), 64, dtype=torch.int32), scheme=scheme, page_size=64)


def _at_an_offset(t):
    """``t``'s values in a contiguous tensor whose data starts one element past a 16-byte boundary."""
    return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t)


@pytest.mark.parametrize("name", ["q", "page_table", "lengths", "k_codes", "v_params"])
def test_a_misaligned_tensor_is_named_before_the_compiler(name):
    """The kernels take 16-byte aligned pointers: a contiguous slice at a storage offset passed validation and failed
    at the launch, after compiling, with an error naming no argument."""
    args = _paged_case()
    args[name] = _at_an_offset(args[name])
    assert args[name].is_contiguous() and args[name].data_ptr() % 16
    with pytest.raises(ValueError, match=f"{name} must start at a 16-byte aligned address"):
        validate_paged(**args, sm_scale=None)


@pytest.mark.parametrize("num_splits", [MAX_DECODE_SPLITS + 1, 10**6])
def test_num_splits_past_the_maximum_is_refused(num_splits):
    with pytest.raises(ValueError, match=rf"num_splits must be None or an int in \[1, {MAX_DECODE_SPLITS}\]"):
        decode_paged(**_paged_case(), num_splits=num_splits)


def test_split_partials_past_32_bit_offsets_are_refused():
    """128 splits at batch 4096 x 64 query heads x 128 channels: the combine kernel's partials hold 2^32 elements at
    32-bit row offsets (reads before the buffer)."""
    with pytest.raises(ValueError, match="num_splits=128: the partial outputs"):
        decode_paged(**_paged_case(batch=4096, kv_heads=8, gqa=8), num_splits=MAX_DECODE_SPLITS)


def test_a_batch_past_the_grid_limit_is_refused():
    """The grid's z extent holds 65535 sequences: a larger batch failed at the launch ('invalid argument')."""
    with pytest.raises(ValueError, match="q: 65536 sequences of 1 KV heads; one launch takes at most 65535"):
        validate_paged(**_paged_case(batch=65536, kv_heads=1, gqa=1), sm_scale=None)

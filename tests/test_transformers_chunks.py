"""FoscarCache past one prefill and one-token steps: a second ``generate`` on the same cache (a new turn),
chunked prefill, assisted generation with prompt lookup (``crop`` of rejected draft tokens), and the errors of
chunks and crops. Against transformers' DynamicCache on SmolLM2-135M (the GGUF of benchmarks/accuracy.py) on
the CPU and, in the GPU tests, on the H200; the tiny random Llama of tests/test_transformers.py where no real
model is needed.

BF16 (sink + window hold every token) equals DynamicCache token for token, up to near-ties: FOSCAR attends in
fp32 where SDPA rounds otherwise, and the logits are BF16, so two runs may part where the reference's token and
the other lie within a few BF16 steps (:func:`tie`). Measured on the CPU: DynamicCache's and FoscarCache's
one-token steps part 9 tokens into a 400-token Genesis prompt at a margin of one step (0.125); DynamicCache fed
a prompt in chunks differs from one forward by 0.13 on average, 1.4 at most, over logits of scale 5.8, and
FoscarCache by 0.15 and 1.8. Logits are held to that baseline, DynamicCache on the same path, or to the BF16 one
forward's own error against the model in FP32 where that is larger: on the H200 DynamicCache's chunked path gave
its one forward's logits exactly (errors 0.0), a baseline of 0, while FoscarCache's was 0.15 from them; a BF16
forward is 0.130 from the FP32 model's on average there (0.136 on the CPU, where FoscarCache's chunked path is 0.130
from the FP32 logits)."""

import copy
import itertools
import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional integration)")

from benchmarks import accuracy  # noqa: E402
from foscar.cache import PagePoolFull  # noqa: E402
from foscar.integrations.transformers import FoscarCache, cache_kwargs  # noqa: E402
from test_transformers import tiny_model  # noqa: E402

BF16 = dict(bits=4, sink=64, window=1024)  # every token of these tests stays in the 16-bit parts
INT4 = dict(bits=4, sink=16, window=64)  # most of them quantized
PROMPT, TURN1, TURN2 = 300, 12, 16
NEW_TURN = " And God said unto Noah, The end of all flesh is come before me; make thee an ark of gopher wood."


@pytest.fixture(scope="module")
def smollm():
    """(tokenizer, model on the CPU, the Genesis prompt [1, PROMPT])."""
    accuracy.require_sources()
    tokenizer, model = accuracy.load_model()
    ids = tokenizer(accuracy.load_text()[:4000], add_special_tokens=False, return_tensors="pt").input_ids
    return tokenizer, model, ids[:, :PROMPT]


@pytest.fixture(scope="module")
def smollm_cuda(smollm):
    """The same on the GPU (a model of its own: the CPU one stays where it is)."""
    tokenizer, model, ids = smollm
    return tokenizer, copy.deepcopy(model).to("cuda"), ids.cuda()


def dynamic(model):
    return transformers.DynamicCache(config=model.config)


def foscar(model, options, max_seq_len=1024):
    return FoscarCache(model, max_batch_size=1, max_seq_len=max_seq_len, **options)


@torch.no_grad()
def greedy(model, ids, cache, steps, **options):
    """``generate(do_sample=False)`` of ``steps`` tokens (no EOS stop): (new tokens [steps], logits [steps, V])."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                         eos_token_id=None, output_logits=True, return_dict_in_generate=True, **options,
                         **cache_kwargs(cache))
    return out.sequences[0, ids.shape[1]:], torch.cat(out.logits).float()


def tie(logit: float) -> float:
    """Four BF16 steps at ``logit``'s magnitude (0.5 for logits in [16, 32)): logits that close are a near-tie
    (well inside the 1.4 that two BF16 paths of DynamicCache differ by at most)."""
    return 4 * 2.0 ** (math.floor(math.log2(abs(logit))) - 7)


def parting(ref, got, ref_logits):
    """None where ``got`` equals ``ref`` token for token; else (step, the reference's margin there between its
    token and ``got``'s, the near-tie bound there)."""
    differ = (ref != got).nonzero()
    if not len(differ):
        return None
    i = int(differ[0])
    return i, float(ref_logits[i, ref[i]] - ref_logits[i, got[i]]), tie(float(ref_logits[i, ref[i]]))


def assert_equal_up_to_a_tie(ref, got, ref_logits):
    part = parting(ref, got, ref_logits)
    assert part is None or part[1] <= part[2], f"parted from the reference at step {part[0]}, margin {part[1]:.4f}"
    return part


def forward(model, cache, ids):
    return model(input_ids=ids, **cache_kwargs(cache)).logits[0].float()


@torch.no_grad()
def float32_forward(model, ids):
    """The logits of one forward of ``ids`` through an FP32 copy of ``model``: what a BF16 forward's own error is
    measured against."""
    model32 = copy.deepcopy(model)
    for t in itertools.chain(model32.parameters(), model32.buffers()):
        t.data = t.data.float()  # (a GGUF-loaded model refuses .float())
    return forward(model32, dynamic(model32), ids)


@torch.no_grad()
def first_turn(model, cache, prompt, turn1):
    """Feed the prompt and the first turn's tokens as ``generate`` does (a prefill, then one step per token but
    the last): the cache as after generating ``turn1``."""
    forward(model, cache, prompt)
    for t in range(len(turn1) - 1):
        forward(model, cache, turn1[None, t:t + 1])


@torch.no_grad()
def conversation_logits(model, cache, prompt, turn1, chunk, turn2):
    """Teacher-forced logits of a two-turn conversation: :func:`first_turn`, the chunk (its last token and the new
    turn: a second ``generate``'s prefill), then the second turn's tokens one step at a time. Returns the logits
    of every chunk position and step ``[len(chunk) + len(turn2) - 1, V]``."""
    first_turn(model, cache, prompt, turn1)
    logits = [forward(model, cache, chunk)]
    for t in range(len(turn2) - 1):
        logits.append(forward(model, cache, turn2[None, t:t + 1]))
    return torch.cat(logits)


def logit_errors(got, exact):
    err = (got - exact).abs()
    return {"top1": float((got.argmax(-1) == exact.argmax(-1)).float().mean()), "max_err": float(err.max()),
            "mean_err": float(err.mean()), "scale": float(exact.std())}


def path_metrics(got, baseline, exact, exact32):
    """Logit errors of FOSCAR's run (``got``) and of DynamicCache's run on the same path (``baseline``: BF16
    rounding alone) against DynamicCache's logits of the same tokens in one forward (``exact``); and that one
    forward's against the model's in FP32 (``exact32``: the error of the BF16 computation itself)."""
    return {"foscar": logit_errors(got, exact), "dynamic": logit_errors(baseline, exact),
            "bf16": logit_errors(exact, exact32)}


def assert_as_close_as_dynamic(metrics):
    """FOSCAR in BF16 is about as close to the one-forward logits as DynamicCache on the same path, or as that
    forward is to FP32's where that is further (the module docstring; measured on the CPU, mean errors: SmolLM2
    0.15 / 0.13 .. 0.16 / 0.15 at logit scale 5.7; the tiny model 0.0022 / 0.0012 at 0.45, where FOSCAR's fp32
    attention and SDPA's BF16 part by more than SDPA's paths do; on the H200, SmolLM2 0.15 / 0.0, BF16 vs FP32 0.13)."""
    foscar, baseline = metrics["foscar"], metrics["dynamic"]
    noise = max(baseline["mean_err"], metrics["bf16"]["mean_err"])
    assert foscar["mean_err"] <= 2 * noise + 0.002 * foscar["scale"], metrics
    # one near-tie position of the ~41 a SmolLM2 path has (0.024) more than DynamicCache's: transformers 5.24 on the
    # CPU gives 0.927 / 0.951 on the second turn
    assert foscar["top1"] >= baseline["top1"] - 0.03, metrics


def assert_quantized_close(metrics):
    foscar = metrics["foscar"]
    assert foscar["top1"] >= 0.8 and foscar["mean_err"] < 0.15 * foscar["scale"], metrics


def check_second_turn(tokenizer, model, prompt, options, quantized):
    """A second ``generate`` on the same FoscarCache (the whole conversation in, as with DynamicCache) against
    DynamicCache's on the same conversation; and the teacher-forced logits of that path (:func:`conversation_logits`:
    the new turn is a chunk after the cached tokens) against those of the whole conversation in one forward."""
    ref_cache = dynamic(model)
    turn1, _ = greedy(model, prompt, ref_cache, TURN1)
    new = tokenizer(NEW_TURN, add_special_tokens=False, return_tensors="pt").input_ids.to(prompt.device)
    ids2 = torch.cat([prompt, turn1[None], new], 1)
    ref2, ref2_logits = greedy(model, ids2, ref_cache, TURN2)
    cache = foscar(model, options)
    first_turn(model, cache, prompt, turn1)
    got2, _ = greedy(model, ids2, cache, TURN2)  # a second generate on the same cache
    assert cache.get_seq_length() == cache.kv.seq_len(0) == ids2.shape[1] + TURN2 - 1
    chunk = torch.cat([turn1[-1:], new[0]])[None]
    path = chunk.shape[1] + TURN2 - 1  # the positions conversation_logits returns, the last of the conversation
    with torch.no_grad():
        whole = torch.cat([ids2, ref2[None, :-1]], 1)
        exact = forward(model, dynamic(model), whole)[-path:]
    metrics = path_metrics(conversation_logits(model, foscar(model, options), prompt, turn1, chunk, ref2),
                           conversation_logits(model, dynamic(model), prompt, turn1, chunk, ref2), exact,
                           float32_forward(model, whole)[-path:])
    metrics["parting"] = parting(ref2, got2, ref2_logits)
    print(metrics)
    if quantized:
        assert_quantized_close(metrics)
    else:
        assert_equal_up_to_a_tie(ref2, got2, ref2_logits)
        assert_as_close_as_dynamic(metrics)
    return metrics


def check_chunked_prefill(model, prompt, options, quantized, chunks=(1, 37, 100, 64)):
    """The prompt fed in chunks (the first one a prefill, the others attended by attend_chunk) against it in one
    forward: the logits of every position (the next token's among them), FOSCAR's and DynamicCache's fed alike;
    and generate's own chunked prefill (``prefill_chunk_size``) against its unchunked one on FoscarCache."""
    sizes = chunks + (prompt.shape[1] - sum(chunks),)

    @torch.no_grad()
    def chunked(cache):
        return torch.cat([forward(model, cache, part) for part in prompt.split(sizes, dim=1)])

    with torch.no_grad():
        exact = forward(model, dynamic(model), prompt)
    metrics = path_metrics(chunked(foscar(model, options)), chunked(dynamic(model)), exact,
                           float32_forward(model, prompt))
    print(metrics)
    if quantized:
        assert_quantized_close(metrics)
    else:
        assert_as_close_as_dynamic(metrics)
    one, one_logits = greedy(model, prompt, foscar(model, options), 8)
    cache = foscar(model, options)
    chunked_tokens, _ = greedy(model, prompt, cache, 8, prefill_chunk_size=64)
    assert cache.get_seq_length() == cache.kv.seq_len(0) == prompt.shape[1] + 7
    if not quantized:  # quantized, one prefill attends every token in 16 bits, chunks attend older ones quantized
        assert_equal_up_to_a_tie(one, chunked_tokens, one_logits)
    return metrics


def check_assisted(model, prompt, options, quantized, steps=40):
    """``generate(prompt_lookup_num_tokens=10)`` on FoscarCache: drafts are accepted and rejected (crop drops the
    rejected ones while the layers hold them), and the tokens are greedy decoding's."""
    cache = foscar(model, options)
    crops = []
    real_crop = cache.crop
    cache.crop = lambda n: crops.append(n) or real_crop(n)
    got, _ = greedy(model, prompt, cache, steps, prompt_lookup_num_tokens=10)
    ref, ref_logits = greedy(model, prompt, foscar(model, options), steps)
    assert any(n < 0 for n in crops), crops  # rejected drafts were cropped
    assert len(crops) < steps - 1, crops  # and accepted ones took several tokens per forward
    assert cache.get_seq_length() == cache.kv.seq_len(0) == prompt.shape[1] + steps - 1
    assert all(layer.held is None for layer in cache.layers)  # the last crop appended what it kept
    part = parting(ref, got, ref_logits)
    print({"crops": crops, "parting": part})
    if quantized:  # a draft crossing a quantization point is attended before the granule is: parting for that too
        assert part is None or part[0] >= steps // 4 or part[1] <= part[2], part
    else:
        assert_equal_up_to_a_tie(ref, got, ref_logits)
        dyn, dyn_logits = greedy(model, prompt, dynamic(model), steps)
        assert_equal_up_to_a_tie(dyn, got, dyn_logits)
    return part


# SmolLM2-135M on the CPU, and the same on the H200 (a model of its own)
SMOLLM = ["smollm", pytest.param("smollm_cuda", marks=pytest.mark.gpu, id="smollm-h200")]


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
@pytest.mark.parametrize("model_fixture", SMOLLM)
def test_second_generate_on_smollm(model_fixture, fmt, request):
    tokenizer, model, prompt = request.getfixturevalue(model_fixture)
    check_second_turn(tokenizer, model, prompt, BF16 if fmt == "bf16" else INT4, quantized=fmt == "int4")


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
@pytest.mark.parametrize("model_fixture", SMOLLM)
def test_chunked_prefill_on_smollm(model_fixture, fmt, request):
    _, model, prompt = request.getfixturevalue(model_fixture)
    check_chunked_prefill(model, prompt, BF16 if fmt == "bf16" else INT4, quantized=fmt == "int4")


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
@pytest.mark.parametrize("model_fixture", SMOLLM)
def test_assisted_generation_on_smollm(model_fixture, fmt, request):
    _, model, prompt = request.getfixturevalue(model_fixture)
    check_assisted(model, prompt, BF16 if fmt == "bf16" else INT4, quantized=fmt == "int4")


# ----------------------------------------------------------------------------- the cache's own contract (tiny model)


def lengths(cache):
    return cache.get_seq_length(), [layer.cumulative_length for layer in cache.layers], cache.kv.lengths.clone()


def test_crop_drops_held_tokens_and_rolls_back_appended_ones():
    """Held chunk tokens (past recording) are dropped, appended ones rolled back: either way the next forward's
    logits are those of a cache that never took the removed tokens, bit for bit (the same cache contents)."""
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(8))
    extra = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(9))
    probe = ids[:, -1:]
    with torch.no_grad():
        def logits(cache, *feeds):
            for feed in feeds:
                out = model(input_ids=feed, **cache_kwargs(cache)).logits
            return out

        for record, feeds, remove in ((True, (ids, extra), 9),  # held chunk, all of it
                                      (True, (ids, extra), 4),  # part of it: the rest is appended
                                      (False, (ids, extra[:, :1], extra[:, 1:2]), 2),  # two appended decode steps
                                      (False, (ids, extra), 3)):  # an appended chunk, within the rollback limit
            cache = FoscarCache(model, max_batch_size=2, max_seq_len=512, **INT4)
            if record:
                cache.activate_past_recording()
            logits(cache, *feeds)
            held = cache.layers[0].held
            assert (held is not None) == record
            kept = extra[:, :sum(f.shape[1] for f in feeds[1:]) - remove]
            cache.crop(-remove)
            fresh = FoscarCache(model, max_batch_size=2, max_seq_len=512, **INT4)
            want = logits(fresh, ids, *((kept,) if kept.shape[1] else ()), probe)
            assert lengths(cache)[0] == ids.shape[1] + kept.shape[1]
            assert torch.equal(logits(cache, probe), want), (record, remove)
            assert torch.equal(cache.kv.lengths, fresh.kv.lengths)


def test_chunk_and_crop_errors_leave_the_cache_unchanged():
    model = tiny_model()
    ids = torch.randint(0, 512, (1, 300), generator=torch.Generator().manual_seed(10))
    cache = FoscarCache(model, max_batch_size=1, max_seq_len=320, **INT4)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"input_ids: 321 tokens per sequence .* max_seq_len=320; build the "
                                             r"FoscarCache with max_seq_len >= 321"):
            model(input_ids=torch.cat([ids, ids[:, :21]], 1), **cache_kwargs(cache))
        assert cache.seq_ids is None and cache.get_seq_length() == 0  # refused before the first allocation
        model(input_ids=ids, **cache_kwargs(cache))
        for _ in range(3):
            model(input_ids=ids[:, :1], **cache_kwargs(cache))
        before = lengths(cache)
        with pytest.raises(ValueError, match=r"input_ids: 324 tokens per sequence .* max_seq_len=320"):
            model(input_ids=ids[:, :21], **cache_kwargs(cache))
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(lengths(cache), before))
        limit = cache.kv.rollback_limit(cache.seq_ids[0])
        assert limit == 303 - 272  # the tokens since the last quantization (at 272)
        for bad, message in ((1, "tokens_to_remove must be an int <= 0"), (-304, "the cache holds 303 tokens"),
                             (-(limit + 1), rf"the last 0 are held and {limit} more can be rolled back")):
            with pytest.raises(ValueError, match=message):
                cache.crop(bad)
            assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                       for a, b in zip(lengths(cache), before))
        cache.crop(-limit)
        assert cache.get_seq_length() == cache.kv.seq_len(0) == 303 - limit
    full = FoscarCache(model, max_batch_size=1, max_seq_len=4096, num_pages=1, **INT4)
    with torch.no_grad(), pytest.raises(PagePoolFull, match=r"1 sequences of 600 tokens need 4 more pages, 1 of "
                                                            r"num_pages=1 are free"):
        model(input_ids=torch.cat([ids, ids], 1), **cache_kwargs(full))
    assert full.seq_ids is None and full.kv.free_pages == 1


def test_second_generate_and_assisted_generation_on_the_tiny_model():
    """The mechanics without the real model (which CI has too, but a plain install may not): a second generate
    on the same cache and assisted generation give DynamicCache's tokens with every token in 16 bits."""
    model = tiny_model()
    prompt = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(11)).repeat(1, 4)
    ref_cache, cache = dynamic(model), foscar(model, BF16)
    for turn in range(2):
        ref, ref_logits = greedy(model, prompt, ref_cache, 10)
        got, _ = greedy(model, prompt, cache, 10)
        assert_equal_up_to_a_tie(ref, got, ref_logits)
        prompt = torch.cat([prompt, ref[None], prompt[:, :17]], 1)
    assert cache.get_seq_length() == prompt.shape[1] - 18
    ref, ref_logits = greedy(model, prompt, dynamic(model), 20)
    got, _ = greedy(model, prompt, foscar(model, BF16), 20, prompt_lookup_num_tokens=5)
    assert_equal_up_to_a_tie(ref, got, ref_logits)
    # a cache sized for the prompt and the new tokens alone: the last drafts run past it, and the error says why
    with pytest.raises(ValueError, match=r"max_seq_len >= \d+ \(assisted generation: its drafts may run up to "
                                         "prompt_lookup_num_tokens"):
        greedy(model, prompt, foscar(model, BF16, prompt.shape[1] + 19), 20, prompt_lookup_num_tokens=5)


@pytest.mark.gpu
def test_second_generate_chunks_and_assisted_generation_on_h200():
    """The tiny model on the GPU (kernel decode, attend_chunk's torch code with pages dequantized per call)."""
    model = tiny_model(layers=2, hidden=512, heads=8, kv_heads=2, head_dim=128, vocab=2048, device="cuda")
    prompt = torch.randint(0, 2048, (1, 200), generator=torch.Generator().manual_seed(12)).cuda()
    int4 = dict(bits=4, k="token", sink=64, window=256)
    for options, quantized in ((dict(bits=4, k="token", sink=64, window=1024), False), (int4, True)):
        check_chunked_prefill(model, prompt.repeat(1, 3), options, quantized)
        check_assisted(model, prompt[:, :50].repeat(1, 8), options, quantized)

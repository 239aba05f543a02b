"""The transformers integration: FoscarCache + the registered "foscar" attention function drive
``model.generate`` of a small Llama built from a config (random weights). CPU runs the torch path;
the GPU test runs the kernels and records agreement with the BF16 cache (FOSCAR_METRICS=path).
GraphedDecode / greedy_generate: eager steps equal ``generate`` (CPU), CUDA-graph replays equal
eager steps token for token and byte for byte in the cache (GPU)."""

import json
import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional integration)")

from foscar.integrations.transformers import (  # noqa: E402
    FoscarCache, GraphedDecode, _dynamic_rope_type, cache_kwargs, greedy_generate, use_foscar)


def tiny_model(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=512, device="cpu", dtype=torch.bfloat16):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      head_dim=head_dim, max_position_embeddings=8192)
    torch.manual_seed(0)
    return use_foscar(transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval())


@torch.no_grad()
def forced_logits(model, ids, cache, new_tokens):
    """Logits of each decode step when feeding ``new_tokens`` (teacher forcing): comparable even
    where greedy choices diverge."""
    logits = [model(input_ids=ids, **cache_kwargs(cache)).logits[:, -1].float()]
    for t in range(new_tokens.shape[1] - 1):
        logits.append(model(input_ids=new_tokens[:, t:t + 1], **cache_kwargs(cache)).logits[:, -1].float())
    return torch.stack(logits, 1)


def compare(model, ids, steps, **cache_options):
    """Greedy generate with the BF16 DynamicCache and with FOSCAR; token agreement and logit errors."""
    config = model.config
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                             **cache_kwargs(transformers.DynamicCache(config=config)))
        new = ref[:, ids.shape[1]:]
        cache = FoscarCache(model, max_batch_size=ids.shape[0], max_seq_len=ids.shape[1] + steps, **cache_options)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                             **cache_kwargs(cache))
        ref_logits = forced_logits(model, ids, transformers.DynamicCache(config=config), new)
        cache = FoscarCache(model, max_batch_size=ids.shape[0], max_seq_len=ids.shape[1] + steps, **cache_options)
        got_logits = forced_logits(model, ids, cache, new)
    same = (out[:, ids.shape[1]:] == new)
    first_diff = (~same).float().argmax(1).where(~same.all(1), torch.tensor(steps, device=ids.device))
    err = (got_logits - ref_logits).abs()
    return {"token_agreement": float(same.float().mean()), "prefix_agreement": float(first_diff.float().mean() / steps),
            "forced_top1": float((got_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
            "logit_max_err": float(err.max()), "logit_mean_err": float(err.mean()),
            "logit_scale": float(ref_logits.std()), "kv_bytes": cache.kv_bytes()}


def test_generate_on_cpu_without_quantized_tokens_matches_bf16():
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(1))
    m = compare(model, ids, 12, bits=4, sink=64, window=256)  # all tokens stay BF16
    assert m["forced_top1"] == 1.0 and m["logit_max_err"] < 0.1 * m["logit_scale"]


@pytest.mark.parametrize("widths", [dict(bits=4), dict(k_bits=4, v_bits=2)], ids=["int4", "k4v2"])
def test_generate_on_cpu_quantized_is_close(widths):
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(2))
    scheme = FoscarCache(model.config, device="cpu", **widths).kv.scheme
    assert (scheme.k.bits, scheme.v.bits) == (4, widths.get("v_bits", 4))
    m = compare(model, ids, 12, sink=16, window=64, **widths)
    # random weights give flat logits: top-1 flips easily, so the gate is mostly on logit error
    assert m["forced_top1"] >= 0.6 and m["logit_mean_err"] < 0.25 * m["logit_scale"], m


@pytest.mark.parametrize("head_dim, channel_group", [(64, 64), (128, 128), (256, 128)])
def test_defaults_are_the_layout_the_accuracy_table_recommends(head_dim, channel_group):
    """K channel-wise (KIVI), V token-wise, rotation on for 2-bit keys (benchmarks/results/accuracy-*.md);
    channel-wise groups of min(head_dim, 128) tokens, which the default page holds for every head_dim."""
    config = tiny_model(layers=1, heads=2, kv_heads=1, head_dim=head_dim).config
    for widths, rotated in ((dict(bits=2), True), (dict(), False), (dict(bits=4), False),
                            (dict(k_bits=4, v_bits=2), False), (dict(k_bits=2, v_bits=4), True)):
        kv = FoscarCache(config, device="cpu", **widths).kv
        assert (kv.scheme.k.axis.value, kv.scheme.k.group) == ("channel", channel_group), widths
        assert (kv.scheme.v.axis.value, kv.scheme.v.group) == ("token", head_dim), widths
        assert (kv.rotation is not None) == rotated, widths
    # explicit choices win: OSCAR's layout, and INT2 without rotation
    oscar = FoscarCache(config, bits=2, k="token", device="cpu").kv
    assert (oscar.scheme.k.axis.value, oscar.scheme.k.group, oscar.rotation is not None) == ("token", head_dim, True)
    assert FoscarCache(config, bits=2, rotate=False, device="cpu").kv.rotation is None


def test_unsupported_uses_raise():
    model = tiny_model()
    ids = torch.randint(0, 512, (1, 20))
    cache = FoscarCache(model.config, max_batch_size=1, max_seq_len=64, device="cpu")
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(cache))
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.reorder_cache(torch.tensor([0]))
    # 2 beams of one sequence are 2 rows: beam search is named, not a batch size over max_batch_size=1
    with pytest.raises(NotImplementedError, match=r"does not support beam search \(generate\(num_beams=2\)\)"), \
            torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, num_beams=2, do_sample=False,
                       **cache_kwargs(FoscarCache(model, max_batch_size=1, max_seq_len=64)))
    with pytest.raises(ValueError, match="max_batch_size"):
        FoscarCache(model.config, max_batch_size=1, device="cpu").layers[0].update(
            torch.zeros(2, 2, 3, 64, dtype=torch.bfloat16), torch.zeros(2, 2, 3, 64, dtype=torch.bfloat16))


def test_padded_batch_is_refused_before_any_token_and_leaves_the_cache_unchanged():
    """A left-padded batch (what a tokenizer gives prompts of unequal length) would attend its pad
    tokens in FOSCAR's decode: refused at the first forward, before any layer appends; an unpadded
    batch of the same cache then generates as usual."""
    model = tiny_model()
    ids = torch.randint(1, 512, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # row 1 left-padded
    cache = FoscarCache(model, bits=4, max_batch_size=2, max_seq_len=128, device="cpu")
    with pytest.raises(ValueError, match="attention_mask: FoscarCache does not support padded batches"), \
            torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **cache_kwargs(cache))
    assert cache.seq_ids is None and cache.get_seq_length() == 0 and not cache.kv._host_len.any()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             **cache_kwargs(cache))
    assert out.shape == (2, 44)


def test_a_4d_mask_hiding_the_causal_past_is_refused_before_any_layer_runs():
    """transformers hands a 4-D mask (or a dict of them) to the layers as it is (no mask builder runs), and FOSCAR's
    decode would attend what it hides: on a FoscarCache it is refused before the first layer, the cache unchanged,
    at a prefill and at a decode step, given by keyword or position, to the model or its decoder, also where the
    FOSCAR attention was chosen without use_foscar; the plain causal mask as a 4-D tensor runs, and so does a hiding
    mask on DynamicCache (SDPA takes it)."""
    from foscar.integrations.transformers import register

    model = tiny_model()
    ids = torch.randint(1, 512, (2, 12), generator=torch.Generator().manual_seed(6))
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[None, None].expand(2, 1, 12, 12)
    hiding = causal.clone()
    hiding[0, :, :, :3] = False  # row 0's first 3 tokens are padding
    hiding[0, :, torch.arange(3), torch.arange(3)] = True  # (each pad token sees itself: no empty softmax row)
    additive = torch.zeros(hiding.shape, dtype=torch.bfloat16).masked_fill(~hiding, -torch.inf)
    cache = FoscarCache(model, bits=4, max_batch_size=2, max_seq_len=64, device="cpu")
    refused = "attention_mask: this 4-D mask .* hides tokens of a query's causal past"
    calls = [lambda: model(input_ids=ids, attention_mask=hiding, **cache_kwargs(cache)),
             lambda: model(input_ids=ids, attention_mask=additive, **cache_kwargs(cache)),
             lambda: model(ids, hiding, **cache_kwargs(cache)),
             lambda: model.model(input_ids=ids, attention_mask=hiding, **cache_kwargs(cache))]
    for call in calls:
        with pytest.raises(ValueError, match=refused), torch.no_grad():
            call()
        assert cache.seq_ids is None and cache.get_seq_length() == 0 and not cache.kv._host_len.any()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=hiding, **cache_kwargs(transformers.DynamicCache(config=model.config)))
        fresh = FoscarCache(model, bits=4, max_batch_size=2, max_seq_len=64, device="cpu")
        want = model(input_ids=ids, **cache_kwargs(fresh)).logits
        assert torch.equal(model(input_ids=ids, attention_mask=causal, **cache_kwargs(cache)).logits, want)
        step = torch.ones(2, 1, 1, 13, dtype=torch.bool)
        step[0, ..., :3] = False  # a decode step's mask hiding the same padding
        held = cache.kv._host_len.clone()
        with pytest.raises(ValueError, match=refused):
            model(input_ids=ids[:, :1], attention_mask=step, **cache_kwargs(cache))
        assert torch.equal(cache.kv._host_len, held) and cache.get_seq_length() == 12
    torch.manual_seed(0)
    chosen = transformers.LlamaForCausalLM(model.config).to(torch.bfloat16).eval()
    chosen.set_attn_implementation(register())  # FOSCAR's attention without use_foscar: FoscarCache puts the check on
    other = FoscarCache(chosen, bits=4, max_batch_size=2, max_seq_len=64, device="cpu")
    with pytest.raises(ValueError, match=refused), torch.no_grad():
        chosen(input_ids=ids, attention_mask=hiding, **cache_kwargs(other))
    qwen = use_foscar(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).to(torch.bfloat16).eval())
    with pytest.raises(ValueError, match=refused), torch.no_grad():  # a dict of masks per layer type
        qwen(input_ids=ids, attention_mask={"full_attention": hiding},
             **cache_kwargs(FoscarCache(qwen, bits=4, max_batch_size=2, max_seq_len=64, device="cpu")))


def test_a_window_shorter_than_max_seq_len_is_refused():
    """FOSCAR attends every cached token: a model whose layers slide over (or attend in chunks of) a shorter window
    would see less."""
    small = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    config = transformers.MistralConfig(**small, head_dim=64, sliding_window=32)
    with pytest.raises(ValueError, match=r"model: its attention slides over a window of 32 tokens.* max_seq_len <= "
                                         r"32 \(got 64\)"):
        FoscarCache(config, max_batch_size=1, max_seq_len=64, device="cpu")
    FoscarCache(config, max_batch_size=1, max_seq_len=32, device="cpu")  # the window never slides
    config.sliding_window = None
    FoscarCache(config, max_batch_size=1, max_seq_len=64, device="cpu")
    gemma = transformers.Gemma2Config(**small, head_dim=64, sliding_window=32)  # alternating sliding / full layers
    with pytest.raises(ValueError, match="slides over a window of 32 tokens"):
        FoscarCache(gemma, max_batch_size=1, max_seq_len=64, device="cpu")
    for layers_past_window, refused in ((0, True), (2, False)):  # Qwen2: layers from max_window_layers on slide
        qwen = transformers.Qwen2Config(**small, sliding_window=32, use_sliding_window=True,
                                        max_window_layers=layers_past_window)
        if refused:
            with pytest.raises(ValueError, match="slides over a window of 32 tokens"):
                FoscarCache(qwen, max_batch_size=1, max_seq_len=64, device="cpu")
        else:
            FoscarCache(qwen, max_batch_size=1, max_seq_len=64, device="cpu")
    with pytest.raises(ValueError, match="max_seq_len must be an int"):  # checked as before, not compared first
        FoscarCache(transformers.MistralConfig(**small, head_dim=64, sliding_window=32), max_seq_len="64", device="cpu")


def test_layer_types_count_only_where_the_config_class_takes_them():
    """MistralConfig does not declare ``layer_types`` (it takes one with a warning) and Mistral picks its mask by
    ``sliding_window`` alone: full-attention layer types leave it sliding, so FoscarCache refuses it. Qwen2 and Gemma 2
    declare them and slide only where they name ``sliding_attention``."""
    small = dict(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, layer_types=["full_attention"] * 2)
    ids = torch.arange(12)[None] % 64
    outputs = []
    for window in (4, None):  # the premise: the model slides whatever layer_types says
        torch.manual_seed(0)
        model = transformers.MistralModel(transformers.MistralConfig(**small, sliding_window=window,
                                                                     attn_implementation="eager")).eval()
        with torch.no_grad():
            outputs.append(model(ids).last_hidden_state)
    assert not torch.allclose(*outputs)
    mistral = transformers.MistralConfig(**small, sliding_window=32)
    for max_seq_len in (64, np.int64(64)):
        with pytest.raises(ValueError, match="model: its attention slides over a window of 32 tokens"):
            FoscarCache(mistral, max_batch_size=1, max_seq_len=max_seq_len, device="cpu")
    FoscarCache(transformers.Gemma2Config(**small, sliding_window=32, attn_logit_softcapping=None), max_batch_size=1,
                max_seq_len=64, device="cpu")
    qwen = transformers.Qwen2Config(**small, sliding_window=32, use_sliding_window=True)
    assert qwen.sliding_window == 32
    FoscarCache(qwen, max_batch_size=1, max_seq_len=64, device="cpu")


def test_non_finite_k_is_refused_before_the_layer_changes_anything():
    """The torch path refuses inf / nan K/V (PagedKVCache.append); a FoscarCache layer refuses it first, naming the
    layer, before it allocates sequences or counts the tokens (a refusal later left the chunk held for good)."""
    cache = FoscarCache(tiny_model().config, bits=4, max_batch_size=1, max_seq_len=64, device="cpu")
    k = torch.zeros(1, 2, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"k holds inf or nan in layer 0 \(the model's activations overflowed\?\)$"):
        cache.layers[0].update(k.clone().fill_(torch.inf), k)
    assert cache.seq_ids is None and cache.layers[0].cumulative_length == 0 and cache.layers[0].held is None
    with pytest.raises(ValueError, match=r"v holds inf or nan in layer 1 .*; layers 0..0 took this forward's tokens: "
                                         r"reset\(\) the cache"):
        cache.layers[1].update(k, k.clone().fill_(torch.nan))
    cache.layers[0].update(k, k)
    assert cache.get_seq_length() == 3


def test_a_decode_step_past_max_seq_len_names_input_ids():
    model = tiny_model()
    ids = torch.randint(1, 512, (1, 12), generator=torch.Generator().manual_seed(7))
    cache = FoscarCache(model, bits=4, max_batch_size=1, max_seq_len=16, device="cpu")
    with pytest.raises(ValueError, match=r"input_ids: 17 tokens per sequence .* max_seq_len=16; build the FoscarCache "
                                         r"with max_seq_len >= 17 \(a generate's prompt and max_new_tokens\)"), torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                       **cache_kwargs(cache))
    assert cache.get_seq_length() == 16


def test_a_model_without_foscar_attention_is_refused_at_every_forward():
    """Without use_foscar the model's own attention would see only the new token at each decode step: refused at the
    first update, and at a later forward after the model's attention was switched away (its logits were silently
    wrong), before that forward changes the cache."""
    config = tiny_model().config
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype=torch.bfloat16).eval()
    model.set_attn_implementation("sdpa")
    cache = FoscarCache(model, bits=4, max_batch_size=1, max_seq_len=64, device="cpu")
    with pytest.raises(ValueError, match="use_foscar"), torch.no_grad():
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), **cache_kwargs(cache))
    assert cache.seq_ids is None and not cache.kv._host_len.any()
    use_foscar(model)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), **cache_kwargs(cache))
    assert cache.get_seq_length() == 4
    model.set_attn_implementation("sdpa")
    for tokens in (1, 3):  # a decode step and a chunk
        with pytest.raises(ValueError, match="use_foscar"), torch.no_grad():
            model(input_ids=torch.zeros(1, tokens, dtype=torch.long), **cache_kwargs(cache))
        assert cache.get_seq_length() == 4 and cache.kv._host_len[:, 0].tolist() == [4] * cache.kv.num_layers


def test_generate_on_cpu_fp16_model_takes_the_models_dtype():
    model = tiny_model(dtype=torch.float16)
    ids = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(4))
    assert FoscarCache(model).kv.scheme.q_dtype == torch.float16
    m = compare(model, ids, 8, bits=4, sink=16, window=64)
    assert m["forced_top1"] >= 0.6 and m["logit_mean_err"] < 0.25 * m["logit_scale"], m


def test_dtype_and_device_defaults_and_errors():
    model = tiny_model()
    assert FoscarCache(model).kv.scheme.q_dtype == torch.bfloat16 and FoscarCache(model).kv.device == model.device
    # a config: CUDA if there is a GPU, else the CPU (no torch.cuda call on a CPU machine)
    assert FoscarCache(model.config).kv.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="dtype: FoscarCache holds float16 or bfloat16"):
        FoscarCache(tiny_model(dtype=torch.float32))
    cache = FoscarCache(model, dtype=torch.float16)
    with pytest.raises(TypeError, match="model computes in torch.bfloat16"), torch.no_grad():
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), **cache_kwargs(cache))


@pytest.mark.gpu
def test_generate_on_h200():
    model = tiny_model(layers=4, hidden=1024, heads=16, kv_heads=4, head_dim=128, vocab=4096, device="cuda")
    ids = torch.randint(0, 4096, (4, 1500), generator=torch.Generator().manual_seed(3)).cuda()
    metrics = {  # the token-wise rows: OSCAR's layout (the FoscarCache default is KIVI's, int2_default)
        "int4": compare(model, ids, 48, bits=4, k="token", sink=64, window=256),
        "int2_sink_window": compare(model, ids, 48, bits=2, k="token", sink=64, window=256, rotate=True),
        "int2_kivi": compare(model, ids, 48, bits=2, k="channel", k_group=128, sink=64, window=256, rotate=False),
        "int2_default": compare(model, ids, 48, bits=2, sink=64, window=256),
        "int4_fp16_model": compare(model.half(), ids, 48, bits=4, k="token", sink=64, window=256),
    }
    if os.environ.get("FOSCAR_METRICS"):
        with open(os.environ["FOSCAR_METRICS"], "w") as f:
            json.dump(metrics, f, indent=1)
    print(json.dumps(metrics, indent=1))
    assert metrics["int4"]["forced_top1"] >= 0.9, metrics
    assert metrics["int2_sink_window"]["forced_top1"] >= 0.5, metrics
    assert metrics["int2_default"]["forced_top1"] >= 0.5, metrics
    assert metrics["int4_fp16_model"]["forced_top1"] >= 0.9, metrics


def reference_greedy(model, ids, steps, **cache_options):
    """``generate(do_sample=False)`` on a FoscarCache, without EOS stopping (random weights may emit EOS)."""
    cache = FoscarCache(model, max_batch_size=ids.shape[0], max_seq_len=512, **cache_options)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                              eos_token_id=None, **cache_kwargs(cache))


@pytest.mark.parametrize("widths", [dict(bits=4), dict(k_bits=4, v_bits=2, rotate=True)], ids=["int4", "k4v2_rotate"])
def test_greedy_generate_eager_steps_equal_generate_on_cpu(widths):
    """The decode step GraphedDecode captures on CUDA, run eagerly: the same tokens as generate. A
    330-token prompt with sink 16 + window 64 quantizes a granule during the steps (at 336 tokens)."""
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 330), generator=torch.Generator().manual_seed(5))
    options = dict(sink=16, window=64, **widths)
    ref = reference_greedy(model, ids, 12, **options)
    cache = FoscarCache(model, max_batch_size=2, max_seq_len=512, **options)
    out = greedy_generate(model, ids, cache, max_new_tokens=12)  # a CPU model: graph defaults to off
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == cache.kv.seq_len(0) == 330 + 11  # the last token is not appended
    # GraphedDecode itself, in two runs: the same steps
    cache = FoscarCache(model, max_batch_size=2, max_seq_len=512, **options)
    with torch.no_grad():
        first = model(input_ids=ids, **cache_kwargs(cache)).logits[:, -1].argmax(-1)
    decode = GraphedDecode(model, cache, first, max_new_tokens=11, graph=False)
    chosen = torch.cat([decode.run(4), decode.run(7)], dim=1)
    assert decode.graph is None and decode.steps_left == 0
    assert torch.equal(torch.cat([ids, first[:, None], chosen], dim=1), ref)
    assert (decode.positions == 330 + 11).all()


def test_graphed_decode_errors():
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(6))
    first = torch.zeros(2, dtype=torch.long)

    def prefilled(**options):
        cache = FoscarCache(model, max_batch_size=2, sink=16, window=64, **options)
        with torch.no_grad():
            model(input_ids=ids, **cache_kwargs(cache))
        return cache

    with pytest.raises(TypeError, match="cache must be a FoscarCache"):
        GraphedDecode(model, transformers.DynamicCache(config=model.config), first, 4)
    with pytest.raises(ValueError, match="cache: empty; prefill first"):
        GraphedDecode(model, FoscarCache(model, max_batch_size=2), first, 4)
    plain = tiny_model()
    plain.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match=r"model: its attention implementation is 'sdpa'.*use_foscar"):
        GraphedDecode(plain, FoscarCache(plain, max_batch_size=2), first, 4)
    cache = prefilled(max_seq_len=128)
    with pytest.raises(ValueError, match="graph=True: CUDA-graph capture needs a CUDA model"):
        GraphedDecode(model, cache, first, 4, graph=True)
    with pytest.raises(ValueError, match=r"next_tokens must be an integer tensor of shape \[batch=2\]"):
        GraphedDecode(model, cache, first[:1], 4)
    with pytest.raises(ValueError, match=r"max_new_tokens=29: .* max_seq_len >= 129"):
        GraphedDecode(model, cache, first, 29)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        GraphedDecode(model, cache, first, 0)
    # prefill fits (100 tokens: none quantized), 200 more steps need 2 pages per sequence
    with pytest.raises(ValueError, match=r"max_new_tokens=200: the steps need 4 more pages, 1 of num_pages=1"):
        GraphedDecode(model, prefilled(max_seq_len=512, num_pages=1), first, 200)
    decode = GraphedDecode(model, cache, first, 4)
    with pytest.raises(ValueError, match=r"steps must be an int in \[0, 4\]"):
        decode.run(5)
    decode.run(2)
    with torch.no_grad():
        model(input_ids=first[:, None], **cache_kwargs(cache))
    with pytest.raises(RuntimeError, match="positions are stale"):
        decode.run(1)
    again = prefilled(max_seq_len=128)
    decode = GraphedDecode(model, again, first, 4)
    again.reset()  # then a prefill of as many tokens: the length matches, the pages reserved for the steps are gone
    with torch.no_grad():
        model(input_ids=ids, **cache_kwargs(again))
    with pytest.raises(RuntimeError, match=r"cache: reset\(\) since this GraphedDecode was built"):
        decode.run(1)
    with pytest.raises(ValueError, match="greedy_generate prefills"):
        greedy_generate(model, ids, cache, 4)
    with pytest.raises(ValueError, match=r"max_new_tokens=30: a 100-token prompt .* max_seq_len >= 129"):
        greedy_generate(model, ids, FoscarCache(model, max_batch_size=2, max_seq_len=128), 30)
    dynamic = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                       rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    # refused with graph=True (a host comparison on the positions); found by the check graph=True makes
    assert _dynamic_rope_type(transformers.LlamaForCausalLM(dynamic)) == "dynamic" and _dynamic_rope_type(model) is None


GRAPH_CONTEXT, GRAPH_STEPS = 600, 70  # sink 64 + window 256, granule 64: a window tile is quantized inside the graph


@pytest.mark.gpu
def test_a_torch_path_cache_on_cuda_decodes_eagerly():
    """A CUDA model with ``FoscarCache(use_kernels=False)``: the torch path checks values on the host as it quantizes,
    which a capture cannot hold, so GraphedDecode runs eagerly by default (and gives the tokens of the kernel path's
    eager steps' shape: one per step) and refuses ``graph=True`` naming it; a raw captured append is refused too."""
    model = tiny_model(device="cuda")
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(3)).cuda()
    cache = FoscarCache(model, max_batch_size=2, max_seq_len=128, use_kernels=False)
    with torch.no_grad():
        first = model(input_ids=ids, **cache_kwargs(cache)).logits[:, -1].argmax(-1)
    with pytest.raises(ValueError, match=r"graph=True: the cache's torch path \(use_kernels=False\)"):
        GraphedDecode(model, cache, first, 4, graph=True)
    decode = GraphedDecode(model, cache, first, 4)
    assert decode.graph is None and not decode.use_graph
    assert decode.run(3).shape == (2, 3) and cache.get_seq_length() == 43
    kv, seq = cache.kv, cache.seq_ids
    k = torch.randn(len(seq), kv.kv_heads, 1, kv.scheme.head_dim, device="cuda", dtype=kv.scheme.q_dtype)
    held = kv.lengths.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), pytest.raises(RuntimeError, match="torch path"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            kv.append(0, seq, k, k)
    assert torch.equal(kv.lengths, held)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["int4", "int2_rotate", "int4_fp16_model"])
def test_graph_replay_equals_eager_on_h200(case):
    """GraphedDecode on CUDA: the warm-up step, then GRAPH_STEPS replays of the captured step choose the
    tokens eager steps choose, every step, and leave the cache byte-identical (the 600 -> 671-token
    sequences cross 640, so a window tile is quantized inside a replay); afterwards the layers' host
    length is right (an eager step on both caches agrees). greedy_generate(graph=True) gives the same."""
    dtype = torch.float16 if case == "int4_fp16_model" else torch.bfloat16
    # K token-wise (64-token granule): the 600 -> 671-token sequences quantize a tile inside the graph
    options = dict(bits=2, k="token", rotate=True) if case == "int2_rotate" else dict(bits=4, k="token")
    model = tiny_model(layers=2, hidden=512, heads=8, kv_heads=2, head_dim=128, vocab=2048, device="cuda",
                       dtype=dtype)
    ids = torch.randint(0, 2048, (2, GRAPH_CONTEXT), generator=torch.Generator().manual_seed(7)).cuda()
    new_cache = lambda: FoscarCache(model, max_batch_size=2, max_seq_len=1024, sink=64, window=256,  # noqa: E731
                                    **options)
    decodes = {}
    for graph in (True, False):
        cache = new_cache()
        with torch.no_grad():  # logits_to_keep=1 as greedy_generate's prefill: the same lm_head GEMM, the same bits
            first = model(input_ids=ids, logits_to_keep=1, **cache_kwargs(cache)).logits[:, -1].argmax(-1)
        decodes[graph] = GraphedDecode(model, cache, first, GRAPH_STEPS + 1, graph=graph)
    graphed, eager = decodes[True], decodes[False]
    assert torch.equal(graphed.tokens, eager.tokens)
    chosen = []
    for step in range(GRAPH_STEPS + 1):  # step 0: the eager warm-up, then the capture; replays after
        tokens = graphed.run(1)
        assert torch.equal(tokens, eager.run(1)), step
        chosen.append(tokens)
    assert graphed.graph is not None and eager.graph is None
    assert torch.equal(graphed.positions, eager.positions)
    assert (graphed.positions == GRAPH_CONTEXT + GRAPH_STEPS + 1).all()
    g, e = graphed.cache.kv, eager.cache.kv
    for part in ("k_codes", "k_params", "v_codes", "v_params", "k_bf16", "v_bf16", "lengths"):
        assert torch.equal(getattr(g, part), getattr(e, part)), part
    assert (g.lengths[:, :2] == GRAPH_CONTEXT + GRAPH_STEPS + 1).all()
    assert g.quantized_tokens(GRAPH_CONTEXT + GRAPH_STEPS + 1) > g.quantized_tokens(GRAPH_CONTEXT)
    for decode in (graphed, eager):
        assert decode.cache.get_seq_length() == decode.cache.kv.seq_len(1) == GRAPH_CONTEXT + GRAPH_STEPS + 1
    with torch.no_grad():  # eager use after the replays: positions from the host length, appends planned on the host
        after = [model(input_ids=graphed.tokens, **cache_kwargs(d.cache)).logits for d in (graphed, eager)]
    assert torch.equal(*after)
    out = greedy_generate(model, ids, new_cache(), GRAPH_STEPS + 2, graph=True)
    assert torch.equal(out[:, GRAPH_CONTEXT + 1:], torch.cat(chosen, dim=1))

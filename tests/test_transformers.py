"""The transformers integration: FoscarCache + the registered "foscar" attention function drive
``model.generate`` of a small Llama built from a config (random weights). CPU runs the torch path;
the GPU test runs the kernels and records agreement with the BF16 cache (FOSCAR_METRICS=path)."""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional integration)")

from foscar.integrations.transformers import FoscarCache, use_foscar  # noqa: E402


def tiny_model(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=512, device="cpu"):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      head_dim=head_dim, max_position_embeddings=8192)
    torch.manual_seed(0)
    return use_foscar(transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval())


@torch.no_grad()
def forced_logits(model, ids, cache, new_tokens):
    """Logits of each decode step when feeding ``new_tokens`` (teacher forcing): comparable even
    where greedy choices diverge."""
    logits = [model(input_ids=ids, past_key_values=cache).logits[:, -1].float()]
    for t in range(new_tokens.shape[1] - 1):
        logits.append(model(input_ids=new_tokens[:, t:t + 1], past_key_values=cache).logits[:, -1].float())
    return torch.stack(logits, 1)


def compare(model, ids, steps, **cache_kwargs):
    """Greedy generate with the BF16 DynamicCache and with FOSCAR; token agreement and logit errors."""
    config, device = model.config, ids.device
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                             past_key_values=transformers.DynamicCache(config=config))
        new = ref[:, ids.shape[1]:]
        cache = FoscarCache(config, max_batch_size=ids.shape[0], max_seq_len=ids.shape[1] + steps, device=device,
                            **cache_kwargs)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                             past_key_values=cache)
        ref_logits = forced_logits(model, ids, transformers.DynamicCache(config=config), new)
        cache = FoscarCache(config, max_batch_size=ids.shape[0], max_seq_len=ids.shape[1] + steps, device=device,
                            **cache_kwargs)
        got_logits = forced_logits(model, ids, cache, new)
    same = (out[:, ids.shape[1]:] == new)
    first_diff = (~same).float().argmax(1).where(~same.all(1), torch.tensor(steps, device=device))
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


def test_unsupported_uses_raise():
    model = tiny_model()
    ids = torch.randint(0, 512, (1, 20))
    cache = FoscarCache(model.config, max_batch_size=1, max_seq_len=64, device="cpu")
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        with pytest.raises(NotImplementedError, match="chunked prefill"):
            model(input_ids=ids[:, :5], past_key_values=cache)
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.reorder_cache(torch.tensor([0]))
    with pytest.raises(ValueError, match="max_batch_size"):
        FoscarCache(model.config, max_batch_size=1, device="cpu").layers[0].update(
            torch.zeros(2, 2, 3, 64, dtype=torch.bfloat16), torch.zeros(2, 2, 3, 64, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_generate_on_h200():
    model = tiny_model(layers=4, hidden=1024, heads=16, kv_heads=4, head_dim=128, vocab=4096, device="cuda")
    ids = torch.randint(0, 4096, (4, 1500), generator=torch.Generator().manual_seed(3)).cuda()
    metrics = {
        "int4": compare(model, ids, 48, bits=4, sink=64, window=256),
        "int2_sink_window": compare(model, ids, 48, bits=2, sink=64, window=256, rotate=True),
        "int2_kivi": compare(model, ids, 48, bits=2, k="channel", k_group=128, sink=64, window=256),
    }
    if os.environ.get("FOSCAR_METRICS"):
        with open(os.environ["FOSCAR_METRICS"], "w") as f:
            json.dump(metrics, f, indent=1)
    print(json.dumps(metrics, indent=1))
    assert metrics["int4"]["forced_top1"] >= 0.9, metrics
    assert metrics["int2_sink_window"]["forced_top1"] >= 0.5, metrics

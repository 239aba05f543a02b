"""FoscarCache on model families beyond Llama (tiny random models built from configs, CPU, BF16): the attention
FOSCAR does not compute (learned sinks, ALiBi, logit soft-capping, KV-shared layers, latent attention) and hybrid
models' recurrent layers are refused before any token, configs without ``num_key_value_heads`` (GPT-2, GPT-NeoX:
multi-head) take their query heads and generate what DynamicCache does, and a cache an interrupted forward left with
layers of different lengths is refused (a helper's audit found each giving wrong text or an unclear crash)."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional integration)")

from foscar.integrations.transformers import FoscarCache, cache_kwargs, use_foscar  # noqa: E402
from test_transformers_chunks import assert_equal_up_to_a_tie  # noqa: E402

SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
BF16 = dict(bits=4, sink=64, window=1024)  # every token stays in the 16-bit parts: DynamicCache's logits up to BF16


def build(config_class: str, **kw):
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**kw)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(6.0)  # sharper logits than random weights give: fewer near-ties
    return model


def generate(model, cache, ids, steps):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **cache_kwargs(cache))
    return out.sequences, torch.stack(out.logits).float()


def ids_of(batch, tokens, seed=1):
    return torch.randint(1, 512, (batch, tokens), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("config_class, kw, match", [
    ("GptOssConfig", dict(SMALL, head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=256),
     "learned attention sinks"),
    ("FalconConfig", dict(vocab_size=512, hidden_size=256, num_attention_heads=4, num_hidden_layers=2, alibi=True),
     "ALiBi"),
    ("Gemma2Config", dict(SMALL, head_dim=64), r"attention logit soft-capping \(50"),
    ("Gemma3nTextConfig", dict(SMALL, vocab_size_per_layer_input=512, hidden_size_per_layer_input=16,
                               num_hidden_layers=4, head_dim=64, sliding_window=512,
                               layer_types=["full_attention"] * 4, activation_sparsity_pattern=[0.0] * 4,
                               laurel_rank=8, altup_num_inputs=2, num_kv_shared_layers=2),
     r"KV-shared layers \(2\)"),
    ("DeepseekV3Config", dict(SMALL, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
                              qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=2, n_routed_experts=4),
     r"multi-head latent attention \(kv_lora_rank 32")],
    ids=["gpt-oss", "falcon-alibi", "gemma2", "gemma3n", "deepseek-v3-mla"])
def test_attention_foscar_does_not_compute_is_refused_at_the_cache(config_class, kw, match):
    """GPT-OSS's sinks and Falcon's ALiBi (in a mask of its own) were dropped unseen: every greedy token differed;
    Gemma 2 failed in SDPA after a layer had taken the prompt; Gemma 3n's shared layers crashed on a second turn;
    DeepSeek's latent attention failed at the first update with a misleading head count."""
    model = use_foscar(build(config_class, **kw))
    with pytest.raises(ValueError, match=f"model: its attention has .*{match}.*which FoscarCache's attention does "
                                         "not compute"):
        FoscarCache(model, max_seq_len=256, **BF16)


@pytest.mark.parametrize("config_class, kw, kind", [
    ("Qwen3NextConfig", dict(SMALL, head_dim=64, num_hidden_layers=4, num_experts=4), "linear_attention"),
    ("JambaConfig", dict(SMALL, num_hidden_layers=4, num_experts=1, attn_layer_period=2, attn_layer_offset=1),
     "linear_attention', 'mamba"),
    ("FalconH1Config", dict(SMALL, head_dim=64, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16), "hybrid"),
    ("Lfm2Config", dict(SMALL, layer_types=["conv", "full_attention"]), "conv")],
    ids=["qwen3-next", "jamba", "falcon-h1", "lfm2"])
def test_a_hybrid_model_is_refused_at_the_cache(config_class, kw, kind):
    """Hybrid models (recurrent layers beside attention) failed at generate with transformers' own message about a
    recurrent state the cache's layers lack; now refused by name when the cache is built, from the model or its
    config."""
    if not hasattr(transformers, config_class):
        pytest.skip(f"this transformers has no {config_class}")
    model = use_foscar(build(config_class, **kw))
    for model_or_config in (model, model.config):
        with pytest.raises(ValueError, match=f"model: its layers include '{kind}', and FoscarCache caches and attends "
                                             "the K/V of full, sliding and chunked attention layers only"):
            FoscarCache(model_or_config, max_seq_len=256, **BF16)


def test_layer_kinds_without_state_beside_attention_are_taken():
    """Nemotron-H's list of layer kinds names its MLP (and MoE) layers beside its mixers: a pattern of attention and
    MLP layers alone is a model FoscarCache takes (its mamba layers are what is refused)."""
    if not hasattr(transformers, "NemotronHConfig"):
        pytest.skip("this transformers has no NemotronHConfig")
    config = transformers.NemotronHConfig(**SMALL, head_dim=64, hybrid_override_pattern="*-*E")
    assert set(config.layers_block_type) == {"full_attention", "mlp", "moe"}
    assert FoscarCache(config, max_seq_len=256, **BF16).kv.num_layers == 4


def test_the_attention_function_refuses_sinks_it_would_drop():
    """``use_foscar`` takes a model past transformers' refusal of SDPA for GPT-OSS; with any cache, the sinks are
    refused rather than dropped by SDPA's function."""
    model = use_foscar(build("GptOssConfig", **SMALL, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                             sliding_window=256))
    with pytest.raises(ValueError, match=r"its attention passes \['s_aux'\]"):
        generate(model, transformers.DynamicCache(config=model.config), ids_of(1, 8), 2)


FAMILIES = {
    "llama-gqa2": ("LlamaConfig", dict(SMALL, head_dim=64)),
    "qwen2": ("Qwen2Config", dict(SMALL)),
    "qwen3": ("Qwen3Config", dict(SMALL, head_dim=64)),
    "mistral": ("MistralConfig", dict(SMALL, head_dim=64, sliding_window=4096)),
    "gemma": ("GemmaConfig", dict(SMALL, head_dim=64)),
    "gemma3": ("Gemma3TextConfig", dict(SMALL, head_dim=64, sliding_window=4096)),
    "gpt-neox": ("GPTNeoXConfig", dict(hidden_size=256, num_attention_heads=4, num_hidden_layers=2,
                                       intermediate_size=512, vocab_size=512)),  # no num_key_value_heads
    "gpt2": ("GPT2Config", dict(n_embd=256, n_head=4, n_layer=2, vocab_size=512)),  # no num_key_value_heads
}


@pytest.mark.parametrize("family", FAMILIES)
def test_model_families_generate_what_dynamic_cache_does(family):
    """Tokens and logits of a batch of 2 against DynamicCache's, every token in 16 bits (BF16 rounding only): each
    row the same tokens, or parting from DynamicCache's at a near-tie of its logits (the CPU's BF16 matmuls round
    differently by ISA: Qwen3's second row parts at a margin of 0.031 on an AVX-512 machine), and the same logits up
    to where it parts. GPT-2 and GPT-NeoX, whose configs have no ``num_key_value_heads``, raised AttributeError at
    ``FoscarCache(model)``."""
    config_class, kw = FAMILIES[family]
    ref = build(config_class, **kw)
    model = use_foscar(copy.deepcopy(ref))
    ids = ids_of(2, 40)
    want_tokens, want = generate(ref, transformers.DynamicCache(config=ref.config), ids, 8)
    got_tokens, got = generate(model, FoscarCache(model, max_batch_size=2, max_seq_len=256, **BF16), ids, 8)
    new = slice(ids.shape[1], None)
    for row in range(ids.shape[0]):
        part = assert_equal_up_to_a_tie(want_tokens[row, new], got_tokens[row, new], want[:, row])
        same_past = want.shape[0] if part is None else part[0] + 1  # the steps before the parting, and its own
        error = float((got[:same_past, row] - want[:same_past, row]).abs().max())
        assert error < 0.1 * float(want.std()), f"row {row}: logits {error:.4f} from DynamicCache's"  # BF16 rounding


def test_a_cache_an_interrupted_forward_left_uneven_is_refused():
    """A Ctrl-C (an OOM) between layers left layer 0 with a turn layer 1 lacks; the next generate went on with
    layer 1 missing it (first logits 1.6 off), where DynamicCache raises."""
    model = use_foscar(build("LlamaConfig", **SMALL, head_dim=64))
    turn1, turn2, turn3 = ids_of(1, 40), ids_of(1, 30, seed=2), ids_of(1, 6, seed=3)
    cache = FoscarCache(model, max_seq_len=256, **BF16)

    def interrupt(module, args, kwargs):
        raise KeyboardInterrupt

    first, _ = generate(model, cache, turn1, 4)
    conversation = torch.cat([first, turn2], 1)
    hook = model.model.layers[1].self_attn.register_forward_pre_hook(interrupt, with_kwargs=True)
    with pytest.raises(KeyboardInterrupt):
        generate(model, cache, conversation, 4)
    hook.remove()
    assert [layer.get_seq_length() for layer in cache.layers] == [74, 43]  # layer 0 took the turn, layer 1 not
    with pytest.raises(ValueError, match=r"cache: layer 1 holds \d+ tokens and layer 0 \d+ .*reset\(\) the cache"):
        generate(model, cache, torch.cat([conversation, turn3], 1), 4)
    cache.reset()
    generate(model, cache, turn1, 4)  # after reset() the cache serves again

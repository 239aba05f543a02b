"""Hugging Face transformers on FOSCAR: a ``Cache`` and a registered attention function.

    from foscar.integrations.transformers import FoscarCache, use_foscar
    use_foscar(model)                                   # registers "foscar" and selects it
    cache = FoscarCache(model, bits=2, max_batch_size=8, max_seq_len=32768)   # the model's dtype and device
    out = model.generate(input_ids, cache=cache, max_new_tokens=256, do_sample=False)

The defaults are the layout the accuracy evaluation recommends (``benchmarks/results/accuracy-*.md``):
K grouped per channel (KIVI), V per token, and the Hadamard rotation of K and Q when K is 2-bit; INT2
that way costs SmolLM2-135M +4.6% perplexity over the BF16 cache, INT4 +0.4% (:func:`FoscarCache`).

(transformers before the ``cache=`` rename, e.g. 5.17, takes ``past_key_values=cache``;
:func:`cache_kwargs` gives whichever the installed version takes.)

How the two halves meet. A Llama/Qwen-style attention layer calls ``cache.update(k, v, layer_idx)``
and hands what it returns to the attention function. ``FoscarCache.update`` appends the new
tokens to the paged FOSCAR cache (``foscar.cache.PagedKVCache``: BF16 sink + recent window,
packed INT2/INT4 pages in between) and returns the new K/V themselves:

* prefill (the first update, any number of tokens): the attention function runs SDPA on those BF16
  K/V -- exact, and cheap next to the quantized decode that follows;
* decode (one token): the returned key carries a ``foscar`` attribute (the layer), and the attention
  function runs ``PagedKVCache.attend`` instead -- FOSCAR's kernel over the packed pages merged with the
  BF16 parts;
* a chunk after the prefill (several tokens: chunked prefill, a new turn on the same cache -- a second
  ``generate`` with the whole conversation --, the draft tokens of assisted decoding): the layer holds
  its K/V back while ``PagedKVCache.attend_chunk`` attends it over the cached tokens and, causally, its
  own 16-bit K/V, then appends it. Any length (the cache's ``max_seq_len`` aside); on the GPU the prefix
  is read block by block (``foscar.chunk_attention``; the decode kernel's several query tokens,
  ``PagedKVCache.attend``, come after their append).

Rollback (``crop``: assisted decoding, e.g. ``generate(..., prompt_lookup_num_tokens=10)``, which
transformers prepares with ``activate_past_recording``): the layers then hold each chunk until the next
crop or update, so crop drops rejected draft tokens before they reach the cache; tokens already appended
are rolled back by ``PagedKVCache.truncate``, as far as its ``rollback_limit`` allows (a clear error past
it: their 16-bit slots were reused after quantization).

Greedy decoding as CUDA-graph replays (:class:`GraphedDecode`, :func:`greedy_generate`): after the prefill,
one whole decode step of the model (embedding, every layer's append + FOSCAR attend, logits, argmax) is
captured once and replayed per token, with no host work inside a step (on a CPU model the same steps
run eagerly):

    from foscar.integrations.transformers import greedy_generate
    out = greedy_generate(model, input_ids, cache, max_new_tokens=256)   # like generate(do_sample=False)

Not supported (clear errors): beam search / cache reordering, padded batches (FOSCAR's attention takes
no attention mask: a padded 2-D ``attention_mask``, or a 4-D one that hides part of the causal past, is refused
before the first layer runs, :func:`foscar_mask`, :func:`_refuse_hiding_mask`), a sliding window shorter than
``max_seq_len``, attention FOSCAR's does not compute (learned sinks, ALiBi, logit soft-capping, KV-shared layers,
latent attention) and layers that are not full, sliding or chunked attention (hybrid models' recurrent layers, sparse
attention with an indexer; all refused by :func:`FoscarCache`), a model whose attention is not FOSCAR's (refused at
every forward's first layer: call :func:`use_foscar`), a cache whose layers an interrupted forward left at different
lengths (refused at the next forward: ``reset()`` it).
transformers is imported lazily; it is not a dependency of foscar.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch

from ..cache import PagedKVCache, PagePoolFull
from ..checks import is_int
from ..scheme import Scheme

__all__ = ["ATTENTION_NAME", "FoscarCache", "GraphedDecode", "cache_kwargs", "foscar_attention_forward",
           "foscar_mask", "greedy_generate", "rank_heads", "register", "use_foscar"]

ATTENTION_NAME = "foscar"


def foscar_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The registered attention function: FOSCAR for decode steps on a :class:`FoscarCache`, SDPA otherwise.

    ``query [batch, q_heads, q_len, head_dim]``; returns ``(out [batch, q_len, q_heads, head_dim], None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # what neither SDPA nor FOSCAR computes, and SDPA's function would drop unseen (FoscarCache refuses such models)
    unsupported = [name for name in ("s_aux", "sinks", "softcap") if kwargs.get(name) is not None]
    if unsupported:
        raise ValueError(f"model: its attention passes {unsupported} (learned sinks or logit soft-capping), which "
                         "FOSCAR's attention does not compute")
    layer = getattr(key, "foscar", None)  # set by FoscarCache's update after the prefill
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return layer.attend(query, scaling), None


def foscar_mask(*args, attention_mask=None, **kwargs):
    """SDPA's mask builder, refusing padded batches: FOSCAR's decode attends every token of a sequence
    (it takes no mask), so a padded row would silently attend its pad tokens. transformers builds the
    masks once per forward, before any layer appends to the cache, so a refused call leaves the cache
    unchanged. (One host read of the 2D padding mask per forward; the CUDA-graph steps of
    :class:`GraphedDecode` pass no mask.)"""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError("attention_mask: FoscarCache does not support padded batches (the mask has padding "
                         "positions, which FOSCAR's decode would attend); generate each sequence on its own, or "
                         "batch prompts of equal length")
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register(name: str = ATTENTION_NAME) -> str:
    """Register the attention function (and its mask builder, :func:`foscar_mask`) with transformers
    under ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, foscar_attention_forward)
    AttentionMaskInterface.register(name, foscar_mask)
    return name


def _check_attention(config) -> None:
    """Refuse a model whose attention is not FOSCAR's: its decode steps would attend to the new token only
    (``FoscarCache.update`` returns the new K/V; the attention function reads the cache)."""
    from transformers import AttentionInterface

    configs = [config] + ([config.get_text_config(decoder=True)] if hasattr(config, "get_text_config") else [])
    names = {getattr(c, "_attn_implementation", None) for c in configs}
    if not any(AttentionInterface._global_mapping.get(n) is foscar_attention_forward for n in names if n):
        raise ValueError(f"model: its attention implementation is {sorted(map(str, names))}, not FOSCAR's; call "
                         "foscar.integrations.transformers.use_foscar(model) before generating with a FoscarCache")


def use_foscar(model, name: str = ATTENTION_NAME):
    """Register and select the FOSCAR attention function on ``model`` (and :func:`_install_mask_check`); returns the
    model."""
    model.set_attn_implementation(register(name))
    _install_mask_check(model)
    return model


def _install_mask_check(model) -> None:
    """Put :func:`_refuse_hiding_mask` on ``model`` and its decoder (a caller may run either), once each: by
    :func:`use_foscar`, and by :func:`FoscarCache` for a model whose FOSCAR attention was chosen otherwise
    (``from_pretrained(..., attn_implementation=register())``)."""
    modules = [model] + ([model.get_decoder()] if hasattr(model, "get_decoder") else [])
    for module in dict.fromkeys(m for m in modules if isinstance(m, torch.nn.Module)):
        if not any(hook is _refuse_hiding_mask for hook in module._forward_pre_hooks.values()):
            module.register_forward_pre_hook(_refuse_hiding_mask, with_kwargs=True)


@functools.lru_cache(maxsize=64)
def _forward_signature(forward_type) -> inspect.Signature:
    return inspect.signature(forward_type)


def _refuse_hiding_mask(model, args, kwargs):
    """A forward pre-hook: on a :class:`FoscarCache`, refuse a 4-D ``attention_mask`` (or a dict of them, per layer
    type) that hides a token of a query's causal past (padding, a pattern of the caller's own), before the first
    layer runs. transformers hands such masks to the layers as they are, without the mask builder
    (:func:`foscar_mask`, which refuses padded 2-D masks), and FOSCAR's attention attends every cached token: the
    decode steps would silently attend what the mask hides. (One host read of a mask, only where one is given.)"""
    if args:  # forward(input_ids, attention_mask, ...) or another order: bind by name
        signature = _forward_signature(type(model).forward)
        bound = signature.bind_partial(model, *args, **kwargs).arguments
        var = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
        kwargs = {**bound, **bound.pop(var, {})}
    masks = kwargs.get("attention_mask")
    masks = list(masks.values()) if isinstance(masks, dict) else [masks]
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if not isinstance(getattr(cache, "kv", None), PagedKVCache):
        return
    for mask in masks:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
            continue
        queries, keys = mask.shape[-2:]
        total = cache.get_seq_length() + queries  # the keys FOSCAR attends: the cached tokens and these
        visible = (mask if mask.dtype == torch.bool else mask == 0)[..., :total]
        causal = torch.ones(queries, visible.shape[-1], dtype=torch.bool, device=mask.device).tril(total - queries)
        if keys < total or not bool((visible | ~causal).all()):
            raise ValueError(f"attention_mask: this 4-D mask (shape {list(mask.shape)}) hides tokens of a query's "
                             f"causal past ({total} keys: the cached tokens and these), which FoscarCache's attention "
                             "would attend: it takes no mask. Generate each sequence on its own, or batch prompts of "
                             "equal length")


@functools.cache
def _cache_keyword() -> str:
    from transformers import GenerationMixin

    # newer transformers renamed generate()'s and forward()'s ``past_key_values`` to ``cache``
    # (the old name still works there, with a FutureWarning); older ones know only the old name
    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``{"cache": cache}``, or ``{"past_key_values": cache}`` for a transformers version that
    predates the rename: pass it as ``model.generate(ids, **cache_kwargs(cache))`` or to ``model(...)``."""
    return {_cache_keyword(): cache}


def _layer_base():
    from transformers.cache_utils import CacheLayerMixin

    return CacheLayerMixin


def _make_layer_class():
    class FoscarLayer(_layer_base()):
        """One model layer's view of the shared :class:`PagedKVCache` (transformers' layer API).

        A decode step (one token after the prefill) is appended at once and attended by ``PagedKVCache.attend``.
        A chunk (the prefill, or several tokens after it) is *held*: its K/V stay out of the PagedKVCache while
        it is attended (the prefill by SDPA; a later chunk by ``attend_chunk``, over the cached tokens before it),
        then it is appended: right after its attention, or, once transformers called
        :meth:`activate_past_recording` (assisted decoding), at the next :meth:`crop` (which may drop any of its
        tokens first) or the next update."""

        is_compileable = False
        is_croppable = True
        is_sliding = False

        def __init__(self, owner: "FoscarCache", layer_idx: int):
            super().__init__()
            self.owner, self.layer_idx = owner, layer_idx
            self.cumulative_length = 0  # tokens this layer holds: appended, and held
            self.held = None  # (k, v) [batch, kv_heads, tokens, head_dim] of a chunk not appended yet
            self.record_past = False

        def lazy_initialization(self, key_states, value_states) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True

        def activate_past_recording(self, **options) -> None:
            """Keep each chunk held until the next crop or update (transformers calls this before assisted
            decoding, which crops the rejected draft tokens after each forward). ``options``: what newer transformers
            pass every layer for its recurrent (linear-attention) layers (``recurrent_states_to_keep``); an attention
            layer has no recurrent state, so none applies here (as transformers' own attention layers)."""
            self.record_past = True

        def update(self, key_states, value_states, *args, **kwargs):
            held = self.owner.kv.scheme.q_dtype
            if key_states.dtype != held:
                raise TypeError(f"FoscarCache holds {held} K/V but the model computes in {key_states.dtype}: "
                                f"build the cache with FoscarCache(model, ...) (the model's dtype) or "
                                f"dtype={key_states.dtype}")
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            tokens = key_states.shape[2]
            past = self.cumulative_length
            decode = tokens == 1 and past > 0
            if decode:
                self.owner.check_length(past + tokens, "a generate's prompt and max_new_tokens")
            self.owner.check_values(self.layer_idx, key_states, value_states)
            first = self.owner.layers[0]
            if self.layer_idx and past != first.cumulative_length - tokens:
                raise ValueError(f"cache: layer {self.layer_idx} holds {past} tokens and layer 0 "
                                 f"{first.cumulative_length - tokens} before this forward (a forward was interrupted "
                                 "between layers?); reset() the cache")
            # a chunk's pages are reserved now: a refusal comes before anything changes, and no append fails later
            if self.layer_idx == 0 and self.owner.model_config is not None:  # every forward: it may be switched
                _check_attention(self.owner.model_config)
            drafts = ("assisted generation: its drafts may run up to prompt_lookup_num_tokens (or the assistant's "
                      "tokens) past the prompt and max_new_tokens") if self.record_past else ""
            seq_ids = self.owner.sequences_for(key_states.shape[0], None if decode else past + tokens, drafts)
            self.commit()
            if decode:
                self.owner.kv.append(self.layer_idx, seq_ids, key_states.contiguous(), value_states.contiguous())
            else:
                self.held = (key_states.contiguous(), value_states.contiguous())
            self.cumulative_length += tokens
            if past:
                key_states.foscar = self  # the attention function attends through attend()
            elif not self.record_past:  # the prefill: SDPA attends the new K/V themselves
                self.commit()
            return key_states, value_states

        def attend(self, query, scaling):
            """FOSCAR attention of ``query [batch, heads, q_len, head_dim]`` after an update with ``past > 0``:
            ``[batch, q_len, heads, head_dim]``."""
            kv, seq_ids = self.owner.kv, self.owner.seq_ids
            if self.held is None:  # a decode step
                return kv.attend(self.layer_idx, seq_ids, query[:, :, 0].contiguous(), sm_scale=scaling)[:, None]
            out = kv.attend_chunk(self.layer_idx, seq_ids, query.transpose(1, 2), *self.held, sm_scale=scaling)
            if not self.record_past:
                self.commit()
            return out

        def commit(self) -> None:
            """Append the held chunk, if any, to the PagedKVCache (its pages were reserved when it came)."""
            if self.held is not None:
                self.owner.kv.append(self.layer_idx, self.owner.seq_ids, *self.held)
                self.held = None

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.cumulative_length + query_length, 0

        def get_seq_length(self) -> int:
            return self.cumulative_length

        def get_max_length(self) -> int:
            return self.owner.kv.max_seq_len

        def reset(self) -> None:
            self.cumulative_length = 0
            self.held = None

        def _to_remove(self, tokens_to_remove) -> tuple[int, int]:
            """(held tokens to drop, appended tokens to truncate) for ``crop(tokens_to_remove)``, or the error."""
            if (isinstance(tokens_to_remove, torch.Tensor) and tokens_to_remove.dim() == 0
                    and tokens_to_remove.dtype in (torch.int32, torch.int64)):
                tokens_to_remove = int(tokens_to_remove)  # transformers 5.17's assisted decoding passes a tensor
            if not is_int(tokens_to_remove) or tokens_to_remove > 0:
                raise ValueError(f"tokens_to_remove must be an int <= 0 (minus the tokens to remove, as transformers "
                                 f"passes it), got {tokens_to_remove!r}")
            remove, held = -int(tokens_to_remove), 0 if self.held is None else self.held[0].shape[2]
            if remove > self.cumulative_length:
                raise ValueError(f"tokens_to_remove={tokens_to_remove}: the cache holds {self.cumulative_length} "
                                 "tokens")
            appended = max(0, remove - held)
            if appended:
                limit = min(self.owner.kv.rollback_limit(s, self.layer_idx) for s in self.owner.seq_ids)
                if appended > limit:
                    raise ValueError(
                        f"tokens_to_remove={tokens_to_remove}: of the {self.cumulative_length} tokens of layer "
                        f"{self.layer_idx}, the last {held} are held and {limit} more can be rolled back "
                        "(PagedKVCache.rollback_limit: older ones are quantized, their 16-bit slots reused); "
                        "activate_past_recording() before the forward keeps a chunk's tokens croppable")
            return min(remove, held), appended

        def crop(self, tokens_to_remove) -> None:
            """Remove the last ``-tokens_to_remove`` tokens: held ones are dropped, appended ones rolled back
            (``PagedKVCache.truncate``, within its ``rollback_limit``); the rest of a held chunk is appended."""
            dropped, appended = self._to_remove(tokens_to_remove)
            if appended:
                self.owner.kv.truncate(self.layer_idx, self.owner.seq_ids, appended)
            if dropped:
                k, v = self.held
                keep = k.shape[2] - dropped
                self.held = (k[:, :, :keep], v[:, :, :keep]) if keep else None
            self.cumulative_length -= dropped + appended
            self.commit()

        def _unsupported(self, what):
            raise NotImplementedError(f"FoscarCache does not support {what}")

        def reorder_cache(self, beam_idx):
            self._unsupported("beam search (reorder_cache)")

        def batch_repeat_interleave(self, repeats):
            self._unsupported("batch_repeat_interleave (num_return_sequences > 1, beam search)")

        def batch_select_indices(self, indices):
            self._unsupported("batch_select_indices")

        def offload(self):
            self._unsupported("offloading")

        def prefetch(self):
            self._unsupported("offloading")

    return FoscarLayer


def rank_heads(model, heads: int, kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(query heads, KV heads) that this process's attention layers compute, of the config's global
    ``heads`` and ``kv_heads``: all of them, or on a tensor-parallel model (transformers'
    ``tp_plan``) this rank's share. Read from the first decoder attention layer's key projection (a
    module with ``k_proj`` and ``layer_idx``): its rows are this rank's KV heads (a DTensor's local
    shard; a plain tensor as it is); the ranks are the DTensor mesh dimensions that shard them, else
    the global width over the local one. A model without such a layer (fused QKV) is taken as unsharded."""
    k_proj = next((m.k_proj for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")), None)
    weight = getattr(k_proj, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return heads, kv_heads
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    width, total = local.shape[0], kv_heads * head_dim
    if hasattr(weight, "device_mesh"):  # a DTensor: the mesh dimensions that shard its rows
        ranks = math.prod(weight.device_mesh.size(i) for i, p in enumerate(weight.placements) if p.is_shard(0))
    else:
        ranks = total // width if 0 < width <= total and total % width == 0 else None
    if ranks is None or kv_heads % ranks or width != kv_heads // ranks * head_dim:
        split = f"{ranks} tensor-parallel ranks" if ranks else "the tensor-parallel ranks"
        raise ValueError(f"model: its {heads} query / {kv_heads} KV heads (head_dim {head_dim}) do not divide "
                         f"evenly among {split}: this rank's k_proj computes {width} of the {total} key "
                         "features; shard the attention over a number of ranks that divides both head counts, or "
                         "keep it replicated (a tp_plan without the attention projections)")
    return heads // ranks, kv_heads // ranks


def FoscarCache(model_or_config, bits: int = 4, max_batch_size: int = 1, max_seq_len: int = 4096, sink: int = 64,
                window: int = 256, rotate: bool | None = None, k: str = "channel", k_group: int | None = None,
                v: str = "token", v_group: int | None = None, page_size: int | None = None, num_pages: int | None = None,
                dtype=None, device=None, use_kernels: bool | None = None, *, k_bits: int | None = None,
                v_bits: int | None = None, arch: str | None = None):
    """A transformers ``Cache`` backed by one :class:`PagedKVCache` for all layers of the model.

    ``model_or_config``: the model (preferred: the cache then takes its dtype and device) or its
    config. ``dtype``: the K/V/Q dtype, bfloat16 or float16; default the model's dtype (given a
    config: its ``dtype`` if that is float16 or bfloat16, else bfloat16). ``device``: default the
    model's device (given a config: CUDA if torch has a GPU, else the CPU).

    The layout (the :class:`~foscar.scheme.Scheme`): ``bits`` (2 or 4; ``k_bits`` / ``v_bits``
    override it for one tensor, ``k_bits=4, v_bits=2``: keys are the more sensitive tensor), ``k`` /
    ``v`` the group axis, ``k_group`` / ``v_group`` the group size. The defaults are the layout the
    accuracy evaluation recommends (``benchmarks/results/accuracy-*.md``, SmolLM2-135M, perplexity vs
    the BF16 cache with sink 64 + window 256): K channel-wise as KIVI (``k="channel"``), V token-wise,
    and for 2-bit keys the Hadamard rotation (``rotate=None``: on when K is 2-bit; it rotates K and Q
    only). INT2 that way costs +4.6%; K token-wise INT2 costs +248% without rotation (unusable) and
    +39% with it. INT4 needs no rotation: +0.4% with K channel-wise, +0.8% token-wise; K4V2 +2.2%.
    ``k="token", v="token", rotate=True`` is OSCAR's layout. Groups default to head_dim for token-wise
    groups and to ``min(head_dim, 128)`` tokens for channel-wise ones (a page holds whole channel-wise
    groups, and 128 fits every head_dim; the accuracy table's were 64 tokens at head_dim 64).

    ``arch``: see :class:`PagedKVCache`. ``sink``/``window``: BF16 parts. ``num_pages`` defaults to
    enough for ``max_batch_size`` sequences of ``max_seq_len`` tokens. ``max_seq_len`` bounds the prompt and
    the new tokens, and under assisted generation the draft tokens too: transformers' last drafts may run up
    to ``prompt_lookup_num_tokens`` (or the assistant's draft length) past ``max_length``. A factory (not a class
    statement) so that importing this module does not import transformers.
    """
    from transformers.cache_utils import Cache

    global _FoscarCacheClass
    if _FoscarCacheClass is None:
        layer_class = _make_layer_class()

        class _FoscarCache(Cache):
            """See :func:`FoscarCache`."""

            def __init__(self, kv: PagedKVCache, model_config=None):
                self.kv = kv
                self.seq_ids = None
                self.resets = 0  # reset() calls: a GraphedDecode built before one refuses to run after it
                self.model_config = model_config  # checked at every forward (None: built from a config)
                super().__init__(layers=[layer_class(self, i) for i in range(kv.num_layers)])

            def sequences_for(self, batch: int, total: int | None, what: str = ""):
                """The cache's sequence ids, allocated on the first update (one per batch row); with ``total``,
                pages reserved for that many tokens each (``what``: as :meth:`check_length`). Refused before
                anything changes."""
                kv = self.kv
                if self.seq_ids is None:
                    if batch > kv.max_seqs:
                        _refuse_beam_search()
                        raise ValueError(f"batch size {batch} exceeds max_batch_size={kv.max_seqs}")
                elif batch != len(self.seq_ids):
                    raise ValueError(f"batch size changed from {len(self.seq_ids)} to {batch}; use a new FoscarCache")
                if total is not None:
                    self.check_length(total, what)
                    pages = [len(kv.pages_of(s)) for s in self.seq_ids] if self.seq_ids else [0] * batch
                    need = sum(max(0, kv.pages_for(total) - p) for p in pages)
                    if need > kv.free_pages:
                        raise PagePoolFull(f"input_ids: {batch} sequences of {total} tokens need {need} more pages, "
                                           f"{kv.free_pages} of num_pages={kv.num_pages} are free")
                if self.seq_ids is None:
                    self.seq_ids = [kv.allocate() for _ in range(batch)]
                for seq_id in self.seq_ids if total is not None else ():
                    kv.reserve(seq_id, total)
                return self.seq_ids

            def check_length(self, total: int, what: str = "") -> None:
                """Refuse ``total`` tokens per sequence past the cache's ``max_seq_len`` (a prompt, a chunk, or a
                decode step: ``what`` says what to size it for), naming what to change."""
                if total > self.kv.max_seq_len:
                    raise ValueError(f"input_ids: {total} tokens per sequence with the cached ones exceed the "
                                     f"cache's max_seq_len={self.kv.max_seq_len}; build the FoscarCache with "
                                     f"max_seq_len >= {total}" + (f" ({what})" if what else ""))

            def check_values(self, layer: int, k, v) -> None:
                """The torch path's refusal of inf, nan and beyond-float16 K/V (``PagedKVCache.append``), before layer
                ``layer`` changes anything. Layers before it may have appended this forward's tokens already: the
                message says so."""
                try:
                    self.kv._check_values(k, v)
                except ValueError as err:
                    earlier = f"; layers 0..{layer - 1} took this forward's tokens: reset() the cache" if layer else ""
                    raise ValueError(f"{err} in layer {layer} (the model's activations overflowed?){earlier}") from err

            def crop(self, tokens_to_remove: int) -> None:
                """Remove the last ``-tokens_to_remove`` tokens of every layer (``FoscarLayer.crop``); checked on
                every layer before any changes."""
                for layer in self.layers:
                    layer._to_remove(tokens_to_remove)
                super().crop(tokens_to_remove)

            def commit(self) -> None:
                """Append every layer's held chunk (``FoscarLayer``) to the PagedKVCache now."""
                for layer in self.layers:
                    layer.commit()

            def reset(self):
                if self.seq_ids is not None:
                    for seq_id in self.seq_ids:
                        self.kv.free(seq_id)
                    self.seq_ids = None
                self.resets += 1
                super().reset()

            def kv_bytes(self) -> int:
                """Device bytes the cached sequences occupy (packed pages + BF16 parts, all layers)."""
                return self.kv.used_bytes()

        _FoscarCacheClass = _FoscarCache

    config = getattr(model_or_config, "config", model_or_config)
    is_model = config is not model_or_config
    if dtype is None:
        dtype = model_or_config.dtype if is_model else getattr(config, "dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if not is_model and dtype not in (torch.float16, torch.bfloat16):
            dtype = torch.bfloat16
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype: FoscarCache holds float16 or bfloat16 K/V, got {dtype} (the model's dtype: cast the "
                         "model with model.to(torch.bfloat16), or pass dtype=)")
    if device is None and is_model:
        device = model_or_config.device
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    _check_layer_types(text)
    _check_sliding_window(text, max_seq_len)
    _check_attention_features(text, model_or_config if is_model else None)
    if is_model:
        _install_mask_check(model_or_config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads  # GPT-2, GPT-NeoX: multi-head
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    k_group = _default_group(k, head_dim) if k_group is None else k_group
    v_group = _default_group(v, head_dim) if v_group is None else v_group
    if is_model:
        heads, kv_heads = rank_heads(model_or_config, heads, kv_heads, head_dim)
    scheme = Scheme.make(bits, k, k_group, v, v_group, head_dim, heads // kv_heads, dtype, k_bits=k_bits, v_bits=v_bits)
    rotate = scheme.k.bits == 2 if rotate is None else rotate
    probe = PagedKVCache(scheme, 1, 1, 1, 1, max_seq_len, page_size, sink, window, device="meta", use_kernels=False)
    if num_pages is None:
        num_pages = max(1, max_batch_size * probe.pages_for(max_seq_len))
    kv = PagedKVCache(scheme, text.num_hidden_layers, kv_heads, num_pages, max_batch_size, max_seq_len, page_size, sink,
                      window, rotate, device, use_kernels, arch)
    return _FoscarCacheClass(kv, config if is_model else None)


_FoscarCacheClass = None


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")  # config.layer_types' names
# what else may name a layer of a model FoscarCache takes: the legacy name of full attention (layers_block_type) and
# the MLP kinds Nemotron-H's list names beside its mixers
OTHER_LAYER_TYPES = ("attention", "mlp", "moe")


def _config_layer_types(text_config) -> tuple:
    """``text_config.layer_types`` where the config's class takes it or computes it (Jamba's property), else ():
    elsewhere it is a stray attribute its model ignores (``MistralConfig(layer_types=[...])``)."""
    cls = type(text_config)
    takes = "layer_types" in inspect.signature(cls.__init__).parameters
    if not (takes or isinstance(getattr(cls, "layer_types", None), property)):
        return ()
    return tuple(getattr(text_config, "layer_types", None) or ())


def _check_layer_types(text_config) -> None:
    """Refuse a model with layers that are not full, sliding or chunked attention, as named in ``layer_types`` or
    ``layers_block_type``: hybrid models' recurrent layers (Qwen3-Next's, Bamba's and Granite 4's
    ``"linear_attention"``, Jamba's ``"mamba"``, Falcon-H1's ``"hybrid"``, LFM2's ``"conv"``) hold a state that is
    not K/V, and sparse attention with an indexer (DeepSeek V3.2's ``"indexed_attention"``) attends a subset of the
    tokens that FOSCAR's attention does not pick."""
    kinds = set(_config_layer_types(text_config)) | set(getattr(text_config, "layers_block_type", None) or ())
    other = sorted(kinds - {*ATTENTION_LAYER_TYPES, *OTHER_LAYER_TYPES})
    if other:
        raise ValueError(f"model: its layers include {', '.join(map(repr, other))}, and FoscarCache caches and attends "
                         "the K/V of full, sliding and chunked attention layers only (a recurrent layer's state is not "
                         "K/V; sparse attention picks tokens FOSCAR's does not); use transformers' own cache for this "
                         "model")


def _check_sliding_window(text_config, max_seq_len: int) -> None:
    """Refuse a model whose layers attend through a window shorter than ``max_seq_len``: FOSCAR's attention attends
    every cached token, so past the window its decode steps would see what the model's do not. A config with
    ``layer_types`` slides where it names ``"sliding_attention"`` (over ``sliding_window``) and attends in chunks
    where it names ``"chunked_attention"`` (of ``attention_chunk_size``, Llama 4); one without, wherever it sets
    ``sliding_window`` (Mistral v0.1) unless ``use_sliding_window`` is off. ``layer_types`` counts only where the
    config's class takes it: elsewhere it is a stray attribute its model ignores (``MistralConfig(layer_types=
    ["full_attention", ...], sliding_window=4096)``: transformers warns, and Mistral slides by ``sliding_window``)."""
    layer_types = _config_layer_types(text_config)
    windows = []
    if "sliding_attention" in layer_types or (not layer_types and getattr(text_config, "use_sliding_window", True)):
        windows.append(("slides over a window", getattr(text_config, "sliding_window", None)))
    if "chunked_attention" in layer_types:
        windows.append(("attends in chunks", getattr(text_config, "attention_chunk_size", None)))
    for how, window in windows:
        if is_int(window) and window > 0 and is_int(max_seq_len) and max_seq_len > window:
            raise ValueError(f"model: its attention {how} of {window} tokens, and FoscarCache attends every cached "
                             f"token; build it with max_seq_len <= {window} (got {max_seq_len})")


def _check_attention_features(text_config, model=None) -> None:
    """Refuse attention that FOSCAR's does not compute: logit soft-capping (Gemma 2), ALiBi (carried in the mask,
    Falcon alibi=True), learned attention sinks (GPT-OSS's ``sinks``: SDPA and FOSCAR drop them), KV-shared
    layers (Gemma 3n) and multi-head latent attention (DeepSeek V2/V3), before any token."""
    what = []
    if getattr(text_config, "attn_logit_softcapping", None):
        what.append(f"attention logit soft-capping ({text_config.attn_logit_softcapping})")
    if getattr(text_config, "alibi", False):
        what.append("ALiBi position biases")
    if getattr(text_config, "num_kv_shared_layers", 0):
        what.append(f"KV-shared layers ({text_config.num_kv_shared_layers})")
    if getattr(text_config, "kv_lora_rank", None):  # DeepSeek V2/V3: the layers cache one compressed latent
        what.append(f"multi-head latent attention (kv_lora_rank {text_config.kv_lora_rank}: no per-head K/V)")
    if model is not None and any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        what.append("learned attention sinks")
    if what:
        raise ValueError(f"model: its attention has {', '.join(what)}, which FoscarCache's attention does not compute")


def _refuse_beam_search() -> None:
    """Raise the beam-search refusal if transformers' beam search is on the call stack: its batch
    holds ``num_beams`` rows per sequence, so the first sign of it may be a batch larger than
    ``max_batch_size`` (with room for the beams it is ``reorder_cache``, after the prefill)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "_beam_search" and frame.f_globals.get("__name__", "").startswith("transformers."):
            beams = getattr(frame.f_locals.get("generation_config"), "num_beams", "> 1")
            raise NotImplementedError(f"FoscarCache does not support beam search (generate(num_beams={beams})); "
                                      "decode greedily or by sampling (num_beams=1)")
        frame = frame.f_back


def _default_group(axis, head_dim: int) -> int:
    """FoscarCache's group size: head_dim for token-wise groups, ``min(head_dim, 128)`` tokens for
    channel-wise ones (every page size from 128 up holds them whole, for every head_dim)."""
    return min(head_dim, 128) if axis == "channel" else head_dim


# ----------------------------------------------------------------------------- greedy decoding as CUDA-graph replays


def _check_model_and_cache(model, cache) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _FoscarCacheClass is None or not isinstance(cache, _FoscarCacheClass):
        raise TypeError(f"cache must be a FoscarCache (foscar.integrations.transformers.FoscarCache), "
                        f"got {type(cache).__name__}")
    implementation = model.config._attn_implementation
    if ALL_ATTENTION_FUNCTIONS.get(implementation) is not foscar_attention_forward:
        raise ValueError(f"model: its attention implementation is {implementation!r}, not FOSCAR's; call "
                         "use_foscar(model) first")
    if cache.kv.device != model.device:
        raise ValueError(f"cache: on {cache.kv.device} but the model is on {model.device}; build it with "
                         "FoscarCache(model, ...)")


def _check_positive_int(name: str, value) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _use_graph(model, cache, graph: bool | None) -> bool:
    """Whether to capture the decode step: ``graph``, default on a CUDA model whose cache runs the kernels; refused
    where it cannot work."""
    device = model.device
    graph = device.type == "cuda" and cache.kv.use_kernels if graph is None else bool(graph)
    if graph and device.type != "cuda":
        raise ValueError(f"graph=True: CUDA-graph capture needs a CUDA model, this one is on {device}; "
                         "graph=False runs the steps eagerly")
    if graph and not cache.kv.use_kernels:
        raise ValueError("graph=True: the cache's torch path (use_kernels=False) checks its values on the host as it "
                         "quantizes, which a CUDA graph cannot capture; graph=False runs the steps eagerly")
    if graph and (rope_type := _dynamic_rope_type(model)):
        raise ValueError(f"graph=True: the model's RoPE type {rope_type!r} recomputes its frequencies behind a "
                         "host comparison, which a CUDA graph cannot capture; use graph=False")
    return graph


def _dynamic_rope_type(model) -> str | None:
    """The model's dynamic RoPE type, if any: it recomputes its frequencies behind a host comparison
    on the positions (``seq_len > max_seq_len_cached``), which a CUDA graph cannot capture."""
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)  # a dict of them where layer types differ
        for name in rope_type.values() if isinstance(rope_type, dict) else (rope_type,):
            if isinstance(name, str) and "dynamic" in name:
                return name
    return None


class GraphedDecode:
    """Greedy decode steps of a transformers causal LM on a prefilled :class:`FoscarCache`; on CUDA,
    each step is one CUDA-graph replay of the whole model step::

        logits = model(input_ids, **cache_kwargs(cache)).logits             # the prefill
        decode = GraphedDecode(model, cache, logits[:, -1].argmax(-1), max_new_tokens=255)
        tokens = decode.run(255)                                             # [batch, 255]

    ``next_tokens [batch]`` (or ``[batch, 1]``): the token each sequence takes next (greedy: the
    prefill's argmax). A step feeds the current tokens at the next positions (every layer appends
    their K/V to the cache and attends through FOSCAR), then writes the argmax of the logits back as
    the next tokens; :meth:`run` returns those. ``max_new_tokens``: the steps this object may run
    (tokens appended per sequence): their pages are reserved here, because a replay cannot allocate
    (``PagedKVCache.reserve``). ``graph``: capture the step (default: on a CUDA model); ``False`` runs
    the same step eagerly (the CPU path, and the reference a replay must equal).

    On CUDA the first step runs eagerly on a side stream, as torch asks before a capture: it
    compiles the CuTe kernels, caches the cache's index tensors and initializes cuBLAS, none of which
    may happen inside a capture. Then one step is captured and every later step replays it. The
    static buffers ``tokens`` and ``positions`` (``[batch, 1]``) advance on the device inside a step.

    What transformers allows (read in 5.24, Llama-style models): a one-token forward with explicit
    ``position_ids`` and ``attention_mask=None`` does no host sync and no data-dependent shape: the
    causal mask is skipped (``sdpa_mask`` returns ``None`` for one query without padding; FOSCAR's
    decode attention needs none). Left to itself the model would take its positions from
    ``cache.get_seq_length()``, a host int the graph would freeze, and it checks an all-ones
    attention mask with a host sync; so both are passed here. Dynamic RoPE (``rope_type`` "dynamic")
    compares positions on the host: refused with ``graph``. The layers' host length
    (``get_seq_length``, which sizes transformers' masks and default positions) is not advanced by a
    replay: :meth:`run` advances it after each one, so the cache is right for eager use afterwards.
    Sampling is plain argmax: no logits processors, no stop at EOS (static shapes: cut at EOS
    yourself). Running the model on the cache between :meth:`run` calls is refused (the static
    positions would be stale), and so is :meth:`run` after ``cache.reset()``.
    """

    def __init__(self, model, cache, next_tokens: torch.Tensor, max_new_tokens: int, graph: bool | None = None):
        _check_model_and_cache(model, cache)
        cache.commit()  # a chunk still held (assisted decoding's): appended on the host, not inside the graph
        past = cache.get_seq_length()
        if past == 0:
            raise ValueError("cache: empty; prefill first (model(input_ids, **cache_kwargs(cache))) or use "
                             "greedy_generate")
        batch = len(cache.seq_ids)
        if (not isinstance(next_tokens, torch.Tensor) or next_tokens.dtype not in (torch.int32, torch.int64)
                or list(next_tokens.shape) not in ([batch], [batch, 1])):
            got = (f"{next_tokens.dtype} {list(next_tokens.shape)}" if isinstance(next_tokens, torch.Tensor)
                   else type(next_tokens).__name__)
            raise ValueError(f"next_tokens must be an integer tensor of shape [batch={batch}] or [batch, 1], got {got}")
        _check_positive_int("max_new_tokens", max_new_tokens)
        device = model.device
        graph = _use_graph(model, cache, graph)
        kv, total = cache.kv, past + max_new_tokens
        if total > kv.max_seq_len:
            raise ValueError(f"max_new_tokens={max_new_tokens}: the cache holds {past} tokens per sequence and "
                             f"max_seq_len={kv.max_seq_len}; build it with max_seq_len >= {total}")
        need = sum(max(0, kv.pages_for(total) - len(kv.pages_of(seq_id))) for seq_id in cache.seq_ids)
        if need > kv.free_pages:
            raise ValueError(f"max_new_tokens={max_new_tokens}: the steps need {need} more pages, {kv.free_pages} "
                             f"of num_pages={kv.num_pages} are free")
        for seq_id in cache.seq_ids:
            kv.reserve(seq_id, total)
        self.model, self.cache, self.use_graph = model, cache, graph
        self.tokens = next_tokens.reshape(batch, 1).to(device=device, dtype=torch.int64, copy=True)
        self.positions = torch.full((batch, 1), past, dtype=torch.int64, device=device)
        self.graph = None
        self.steps_left = max_new_tokens
        self._seen = past  # the host length this object expects at its next step
        self._resets = cache.resets  # (a reset gives the reserved pages back: a new prefill of `past` tokens has none)
        self._forward_kwargs = {"attention_mask": None, "position_ids": self.positions, "use_cache": True,
                                **cache_kwargs(cache)}
        if "cache_position" in inspect.signature(model.forward).parameters:
            # transformers that still take it would derive it from the host length: a constant in the graph
            self._forward_kwargs["cache_position"] = self.positions[0]

    def _step(self) -> None:
        logits = self.model(input_ids=self.tokens, **self._forward_kwargs).logits
        self.tokens.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.positions.add_(1)

    def _warm_up_and_capture(self) -> None:
        """One eager step on a side stream (a real step: its token counts), then the capture of one."""
        stream = torch.cuda.Stream(self.tokens.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._step()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        host_lengths = [layer.cumulative_length for layer in self.cache.layers]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._step()
        finally:  # capturing ran a step's host side (the layers counted a token) but appended nothing
            for layer, length in zip(self.cache.layers, host_lengths):
                layer.cumulative_length = length
        self.graph = graph

    @torch.no_grad()
    def run(self, steps: int) -> torch.Tensor:
        """Run ``steps`` decode steps; returns the tokens they chose, ``[batch, steps]`` int64 (on the
        model's device; nothing waits for the GPU here)."""
        if not is_int(steps) or not 0 <= steps <= self.steps_left:
            raise ValueError(f"steps must be an int in [0, {self.steps_left}] (the max_new_tokens left), "
                             f"got {steps!r}")
        if self.cache.resets != self._resets:
            raise RuntimeError("cache: reset() since this GraphedDecode was built, which gave its sequences' reserved "
                               "pages back: build a new GraphedDecode")
        if self.cache.get_seq_length() != self._seen:
            raise RuntimeError(f"cache: holds {self.cache.get_seq_length()} tokens, this GraphedDecode left it at "
                               f"{self._seen} (the model ran on it, or it was reset): its positions are stale; "
                               "build a new GraphedDecode")
        chosen = torch.empty(self.tokens.shape[0], steps, dtype=torch.int64, device=self.tokens.device)
        for step in range(steps):
            if self.graph is not None:
                self.graph.replay()
                for layer in self.cache.layers:  # what the replayed update() would have counted
                    layer.cumulative_length += 1
            elif self.use_graph:
                self._warm_up_and_capture()
            else:
                self._step()
            chosen[:, step] = self.tokens[:, 0]
            self.steps_left -= 1
            self._seen += 1
        return chosen


@torch.no_grad()
def greedy_generate(model, input_ids: torch.Tensor, cache, max_new_tokens: int, graph: bool | None = None):
    """Greedy decoding of same-length prompts on an empty :class:`FoscarCache`, the decode steps as
    CUDA-graph replays (:class:`GraphedDecode`; ``graph`` as there). Returns ``[batch, prompt +
    max_new_tokens]`` like ``model.generate(input_ids, cache=cache, max_new_tokens=..., do_sample=False)``
    without EOS stopping: the prefill chooses the first new token, ``max_new_tokens - 1`` decode steps
    the rest (the last token is not appended to the cache, as in ``generate``)."""
    _check_model_and_cache(model, cache)
    if cache.get_seq_length():
        raise ValueError(f"cache: holds {cache.get_seq_length()} tokens; greedy_generate prefills, so pass an empty "
                         "FoscarCache (or continue with GraphedDecode)")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = list(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be an integer tensor [batch, prompt], got {got}")
    _check_positive_int("max_new_tokens", max_new_tokens)
    graph = _use_graph(model, cache, graph)
    # the checks GraphedDecode makes, before the prefill, which would otherwise run for nothing
    kv, (batch, prompt) = cache.kv, input_ids.shape
    total = prompt + max_new_tokens - 1
    if total > kv.max_seq_len:
        raise ValueError(f"max_new_tokens={max_new_tokens}: a {prompt}-token prompt plus the decode steps need "
                         f"max_seq_len >= {total}, the cache has {kv.max_seq_len}")
    if batch * kv.pages_for(total) > kv.free_pages:
        raise ValueError(f"max_new_tokens={max_new_tokens}: {batch} sequences of {total} tokens need "
                         f"{batch * kv.pages_for(total)} pages, {kv.free_pages} of num_pages={kv.num_pages} are free")
    prefill = cache_kwargs(cache)
    if "logits_to_keep" in inspect.signature(model.forward).parameters:  # as generate does: no [prompt, vocab] logits
        prefill["logits_to_keep"] = 1
    first = model(input_ids=input_ids, **prefill).logits[:, -1].argmax(-1)
    parts = [input_ids, first[:, None].to(input_ids.dtype)]
    if max_new_tokens > 1:
        parts.append(GraphedDecode(model, cache, first, max_new_tokens - 1, graph).run(max_new_tokens - 1).to(
            input_ids.dtype))
    return torch.cat(parts, dim=1)

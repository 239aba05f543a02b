"""Hugging Face transformers on FOSCAR: a ``Cache`` and a registered attention function.

    from foscar.integrations.transformers import FoscarCache, use_foscar
    use_foscar(model)                                   # registers "foscar" and selects it
    cache = FoscarCache(model.config, bits=2, max_batch_size=8, max_seq_len=32768)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=256, do_sample=False)

How the two halves meet. A Llama/Qwen-style attention layer calls ``cache.update(k, v, layer_idx)``
and hands what it returns to the attention function. ``FoscarCache.update`` appends the new
tokens to the paged FOSCAR cache (``foscar.cache.PagedKVCache``: BF16 sink + recent window,
packed INT2/INT4 pages in between) and returns the new K/V themselves:

* prefill (the first update, any number of tokens): the attention function runs SDPA on those BF16
  K/V -- exact, and cheap next to the quantized decode that follows;
* decode (one token): the returned key carries a ``foscar`` attribute (the cache, the layer, the
  sequence ids), and the attention function runs ``PagedKVCache.attend`` instead -- FOSCAR's kernel
  over the packed pages merged with the BF16 parts.

Not supported (clear errors): a second multi-token update after decoding started (chunked prefill,
multi-turn reuse of one cache), beam search / cache reordering, cropping (assisted decoding),
padded batches (the decode path ignores the attention mask: give every sequence the same length).
transformers is imported lazily; it is not a dependency of foscar.
"""

from __future__ import annotations

import torch

from ..cache import PagedKVCache
from ..scheme import Scheme

__all__ = ["ATTENTION_NAME", "FoscarCache", "foscar_attention_forward", "register", "use_foscar"]

ATTENTION_NAME = "foscar"


def foscar_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The registered attention function: FOSCAR for decode steps on a :class:`FoscarCache`, SDPA otherwise.

    ``query [batch, q_heads, q_len, head_dim]``; returns ``(out [batch, q_len, q_heads, head_dim], None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    marker = getattr(key, "foscar", None)
    if marker is None or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv, layer, seq_ids = marker
    out = kv.attend(layer, seq_ids, query[:, :, 0].contiguous(), sm_scale=scaling)
    return out[:, None], None


def register(name: str = ATTENTION_NAME) -> str:
    """Register the attention function (and SDPA's mask builder) with transformers under ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, foscar_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def use_foscar(model, name: str = ATTENTION_NAME):
    """Register and select the FOSCAR attention function on ``model``; returns the model."""
    model.set_attn_implementation(register(name))
    return model


def _layer_base():
    from transformers.cache_utils import CacheLayerMixin

    return CacheLayerMixin


def _make_layer_class():
    class FoscarLayer(_layer_base()):
        """One model layer's view of the shared :class:`PagedKVCache` (transformers' layer API)."""

        is_compileable = False
        is_croppable = False
        is_sliding = False

        def __init__(self, owner: "FoscarCache", layer_idx: int):
            super().__init__()
            self.owner, self.layer_idx = owner, layer_idx
            self.cumulative_length = 0

        def lazy_initialization(self, key_states, value_states) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            tokens = key_states.shape[2]
            past = self.cumulative_length
            if past and tokens != 1:
                raise NotImplementedError(
                    f"FoscarCache: a {tokens}-token update after {past} cached tokens (chunked prefill or reusing the "
                    "cache for a new turn) is not supported; prefill in one call, then decode one token at a time")
            seq_ids = self.owner.sequences_for(key_states.shape[0])
            self.owner.kv.append(self.layer_idx, seq_ids, key_states.contiguous(), value_states.contiguous())
            self.cumulative_length += tokens
            if past:
                key_states.foscar = (self.owner.kv, self.layer_idx, seq_ids)
            return key_states, value_states

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.cumulative_length + query_length, 0

        def get_seq_length(self) -> int:
            return self.cumulative_length

        def get_max_length(self) -> int:
            return self.owner.kv.max_seq_len

        def reset(self) -> None:
            self.cumulative_length = 0

        def _unsupported(self, what):
            raise NotImplementedError(f"FoscarCache does not support {what}")

        def reorder_cache(self, beam_idx):
            self._unsupported("beam search (reorder_cache)")

        def crop(self, tokens_to_remove):
            self._unsupported("crop (assisted decoding)")

        def batch_repeat_interleave(self, repeats):
            self._unsupported("batch_repeat_interleave (num_return_sequences > 1, beam search)")

        def batch_select_indices(self, indices):
            self._unsupported("batch_select_indices")

        def offload(self):
            self._unsupported("offloading")

        def prefetch(self):
            self._unsupported("offloading")

    return FoscarLayer


def FoscarCache(config, bits: int = 4, max_batch_size: int = 1, max_seq_len: int = 4096, sink: int = 64,
                window: int = 256, rotate: bool = False, k: str = "token", k_group: int | None = None, v: str = "token",
                v_group: int | None = None, page_size: int | None = None, num_pages: int | None = None,
                dtype=torch.bfloat16, device="cuda", use_kernels: bool | None = None, *, k_bits: int | None = None,
                v_bits: int | None = None, arch: str | None = None):
    """A transformers ``Cache`` backed by one :class:`PagedKVCache` for all layers of ``config``'s model.

    ``bits``, ``k``/``k_group``, ``v``/``v_group``: the :class:`~foscar.scheme.Scheme` (groups default
    to head_dim; OSCAR: token-wise K and V; KIVI: ``k="channel"``). ``k_bits`` / ``v_bits`` override
    ``bits`` for one tensor (``k_bits=4, v_bits=2``: keys are the more sensitive tensor). ``arch``:
    see :class:`PagedKVCache`. ``sink``/``window``: BF16 parts.
    ``num_pages`` defaults to enough for ``max_batch_size`` sequences of ``max_seq_len`` tokens.
    A factory (not a class statement) so that importing this module does not import transformers.
    """
    from transformers.cache_utils import Cache

    global _FoscarCacheClass
    if _FoscarCacheClass is None:
        layer_class = _make_layer_class()

        class _FoscarCache(Cache):
            """See :func:`FoscarCache`."""

            def __init__(self, kv: PagedKVCache):
                self.kv = kv
                self.seq_ids = None
                super().__init__(layers=[layer_class(self, i) for i in range(kv.num_layers)])

            def sequences_for(self, batch: int):
                """The cache's sequence ids, allocated on the first update (one per batch row)."""
                if self.seq_ids is None:
                    if batch > self.kv.max_seqs:
                        raise ValueError(f"batch size {batch} exceeds max_batch_size={self.kv.max_seqs}")
                    self.seq_ids = [self.kv.allocate() for _ in range(batch)]
                if batch != len(self.seq_ids):
                    raise ValueError(f"batch size changed from {len(self.seq_ids)} to {batch}; use a new FoscarCache")
                return self.seq_ids

            def reset(self):
                if self.seq_ids is not None:
                    for seq_id in self.seq_ids:
                        self.kv.free(seq_id)
                    self.seq_ids = None
                super().reset()

            def kv_bytes(self) -> int:
                """Device bytes the cached sequences occupy (packed pages + BF16 parts, all layers)."""
                return self.kv.used_bytes()

        _FoscarCacheClass = _FoscarCache

    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    scheme = Scheme.make(bits, k, k_group, v, v_group, head_dim, heads // kv_heads, dtype, k_bits=k_bits, v_bits=v_bits)
    probe = PagedKVCache(scheme, 1, 1, 1, 1, max_seq_len, page_size, sink, window, device="meta", use_kernels=False)
    if num_pages is None:
        num_pages = max(1, max_batch_size * probe.pages_for(max_seq_len))
    kv = PagedKVCache(scheme, text.num_hidden_layers, kv_heads, num_pages, max_batch_size, max_seq_len, page_size, sink,
                      window, rotate, device, use_kernels, arch)
    return _FoscarCacheClass(kv)


_FoscarCacheClass = None

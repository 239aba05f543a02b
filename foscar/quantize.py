"""BF16/FP16 K and V -> packed codes + per-group (scale, offset), in pages; and back.

Rounding: each tensor's code format's (``foscar.formats``); the built-in INT2 and INT4 are
asymmetric min-max per group (``MinMaxFormat``: ``offset = fp16(min)``, ``scale = fp16((max - min) /
(2^bits - 1))``, codes rounded half to even against the *stored* fp16 params). Tokens past a
sequence's length take no part in any group's statistics and get code 0.

Cache format (:class:`QuantizedKV`): ``k_codes``/``v_codes`` int32
``[num_pages, kv_heads, page_size // 64, tile_words]`` (each 64-token tile packed as
``foscar.layouts.fragment`` documents), ``k_params``/``v_params`` float16 with last dim
``param_fields`` P (2: scale, offset; 1: the scale alone, a scale-only format):
``[num_pages, kv_heads, page_size, head_dim // G, P]`` for token-wise groups,
``[num_pages, kv_heads, page_size // G, head_dim, P]`` for channel-wise groups. ``page_table``
int32 ``[batch, max_pages]`` and ``lengths`` int32 ``[batch]``: token ``i`` of sequence ``b`` is in
page ``page_table[b, i // page_size]``, slot ``i % page_size``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .checks import is_int
from .formats import PARAM_DTYPE
from .layouts import PACKERS, TILE_TOKENS, TileGeometry
from .scheme import Axis, Scheme, TensorQuant

__all__ = ["PAGE_SIZES", "QuantizedKV", "quantize_groups", "dequantize_groups", "quantize_kv", "smallest_page_size",
           "stack_params", "split_params"]

PAGE_SIZES = (64, 128, 256)


def check_page_size(scheme: Scheme, page_size) -> int:
    """``page_size`` as an int, or a ValueError: a page holds whole 64-token tiles and whole channel-wise groups of
    ``scheme``."""
    if not is_int(page_size) or page_size not in PAGE_SIZES:
        raise ValueError(f"page_size must be one of {PAGE_SIZES}, got {page_size!r}")
    for name, quant in (("k", scheme.k), ("v", scheme.v)):
        if quant.axis is Axis.CHANNEL and page_size % quant.group:
            raise ValueError(f"page_size={page_size} must be a multiple of the channel-wise {name} group {quant.group}")
    return int(page_size)


def smallest_page_size(scheme: Scheme) -> int:
    """The smallest page size that holds whole channel-wise groups of ``scheme`` (64 if none)."""
    return next(p for p in PAGE_SIZES if all(q.axis is Axis.TOKEN or p % q.group == 0 for q in (scheme.k, scheme.v)))


def quantize_groups(x: torch.Tensor, quant: TensorQuant, valid: torch.Tensor | None = None, name: str = "x"):
    """Quantize ``x [..., L, D]`` (named ``name`` in errors) to ``quant.bits`` into codes (uint8, same
    shape) and fp16 scale, offset.

    ``scale``/``offset`` have shape ``[..., L, D // G]`` (token-wise) or ``[..., L // G, D]``
    (channel-wise; L must be a multiple of G). ``valid [..., L]`` (bool) excludes tokens.
    ``name``: what the caller calls ``x`` ("k", "v"), for the value errors.
    """
    if x.dim() < 2:
        raise ValueError(f"x must have shape [..., tokens, channels], got {tuple(x.shape)}")
    length, dim = x.shape[-2:]
    if not isinstance(quant, TensorQuant):
        raise TypeError(f"quant must be a foscar.scheme.TensorQuant, got {type(quant).__name__}")
    if valid is not None and tuple(valid.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"valid must have shape {list(x.shape[:-1])}, got {list(valid.shape)}")
    if quant.axis is Axis.TOKEN and dim % quant.group:
        raise ValueError(f"token-wise group {quant.group} must divide the channel count {dim}")
    if quant.axis is Axis.CHANNEL and length % quant.group:
        raise ValueError(f"channel-wise group {quant.group} must divide the token count {length}")
    mask = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device) if valid is None else valid.to(x.device)
    mask = mask[..., None].expand(x.shape)
    # excluded tokens (a padded batch's padding) may hold anything, nan included: zeros, so that neither the check
    # nor a format's arithmetic meets them
    xf = x.to(torch.float32).masked_fill(~mask, 0)
    if not torch.isfinite(xf).all():
        raise ValueError(f"{name} holds inf or nan")
    grouped = quant.grouped(xf)
    codes, scale, offset = quant.format.quantize(grouped, quant.grouped(mask), name)
    check_quantized(quant.format, grouped.shape, codes, scale, offset)
    codes = codes.to(torch.uint8).reshape(x.shape)
    pshape = (*x.shape[:-2], *quant.params_shape(length, dim))
    return codes, scale.reshape(pshape), None if offset is None else offset.reshape(pshape)


def check_quantized(fmt, grouped_shape, codes, scale, offset) -> None:
    """What ``fmt.quantize`` returned for groups of ``grouped_shape`` ``[..., a, gl, b, gd]``, as the packed pages
    and every kernel take it: whole codes in ``0 .. 2^bits - 1`` (the packing adds codes into shared words, so one out
    of range changes its neighbour), finite fp16 params ``[..., a, 1, b, 1]``, an offset exactly where the format
    stores one. A ValueError naming the format otherwise, before anything is stored."""
    where = f"{fmt.name}.quantize"
    if not isinstance(codes, torch.Tensor) or tuple(codes.shape) != tuple(grouped_shape):
        raise ValueError(f"{where} returned codes of shape {tuple(getattr(codes, 'shape', ()))}, not the groups' "
                         f"{tuple(grouped_shape)}")
    if codes.numel():
        c = codes.double()
        if not bool(torch.isfinite(c).all()) or not bool((c == c.round()).all()):
            raise ValueError(f"{where} returned codes that are not whole numbers (round them)")
        lo, hi = int(c.min()), int(c.max())
        if lo < 0 or hi >= fmt.levels:
            raise ValueError(f"{where} returned codes in {lo} .. {hi}: a {fmt.bits}-bit code is 0 .. {fmt.levels - 1} "
                             "(a signed or centred format stores code + its centre, and says so in dequantize)")
    pshape = (*grouped_shape[:-4], grouped_shape[-4], 1, grouped_shape[-2], 1)
    if (offset is None) != (fmt.param_fields == 1):
        raise ValueError(f"{where} returned {'no' if offset is None else 'an'} offset; a format with param_fields="
                         f"{fmt.param_fields} returns {'None' if fmt.param_fields == 1 else 'one'}")
    for what, t in (("scale", scale), ("offset", offset)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != PARAM_DTYPE or tuple(t.shape) != pshape:
            raise ValueError(f"{where} returned a {what} of {getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}: the pages store {PARAM_DTYPE} {pshape}, one per group")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where} returned a non-finite {what} (a group beyond the float16 range)")


def stack_params(scale, offset, quant: TensorQuant):
    """The stored params ``[..., param_fields]`` of ``scale`` and ``offset`` (None for a scale-only format)."""
    return torch.stack([scale] if quant.param_fields == 1 else [scale, offset], dim=-1)


def split_params(params, quant: TensorQuant):
    """``(scale, offset)`` of stored params ``[..., param_fields]`` (offset None for a scale-only format)."""
    return params[..., 0], (params[..., 1] if quant.param_fields == 2 else None)


def dequantize_groups(codes, scale, offset, quant: TensorQuant, dtype=torch.float32):
    """``scale*code + offset`` for ``codes [..., L, D]`` and the params of :func:`quantize_groups`."""
    if codes.dim() < 2:
        raise ValueError(f"codes must have shape [..., tokens, channels], got {tuple(codes.shape)}")
    want = (*codes.shape[:-2], *quant.params_shape(*codes.shape[-2:]))
    if (offset is None) != (quant.param_fields == 1):
        raise ValueError(f"offset must be None exactly for a scale-only format ({quant.format.name}: param_fields="
                         f"{quant.param_fields}), got {'None' if offset is None else 'a tensor'}")
    for name, t in (("scale", scale), ("offset", offset)):
        if t is not None and tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {list(want)} for codes {list(codes.shape)} and {quant}, got {list(t.shape)}")
    grouped = quant.grouped(codes.to(dtype))
    # params [..., rows, cols] broadcast over the group's two in-group modes
    s, z = (None if t is None else t.to(dtype)[..., :, None, :, None] for t in (scale, offset))
    return quant.format.dequantize(grouped, s, z).reshape(codes.shape)


@dataclass(frozen=True)
class QuantizedKV:
    """A paged quantized KV cache (format in the module docstring)."""

    scheme: Scheme
    page_size: int
    k_codes: torch.Tensor
    k_params: torch.Tensor
    v_codes: torch.Tensor
    v_params: torch.Tensor
    page_table: torch.Tensor
    lengths: torch.Tensor
    layout: str = "hopper"  # bit order inside a tile (foscar.layouts.PACKERS)

    @property
    def batch(self) -> int:
        return self.page_table.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k_codes.shape[1]

    @property
    def max_tokens(self) -> int:
        return self.page_table.shape[1] * self.page_size

    def codes_and_params(self, role: str):
        """Gather per sequence: uint8 codes ``[batch, kv_heads, max_tokens, D]`` and fp16 scale,
        offset ``[batch, kv_heads, *params]`` in token order (what the references consume)."""
        if role not in ("k", "v"):
            raise ValueError(f"role must be 'k' or 'v', got {role!r}")
        codes, params = (self.k_codes, self.k_params) if role == "k" else (self.v_codes, self.v_params)
        quant = self.scheme.k if role == "k" else self.scheme.v
        geom = TileGeometry(role, quant.bits, self.scheme.head_dim)
        table = self.page_table.long()
        batch, max_pages = table.shape
        d = self.scheme.head_dim
        tiles = PACKERS[self.layout][1](codes[table], geom)  # [batch, max_pages, kvh, tiles, 64, D]
        tiles = tiles.permute(0, 2, 1, 3, 4, 5).reshape(batch, self.kv_heads, self.max_tokens, d)
        p = params[table].movedim(2, 1)  # [batch, kvh, max_pages, rows, cols, param_fields]
        p = p.reshape(batch, self.kv_heads, max_pages * p.shape[3], p.shape[4], quant.param_fields)
        return tiles, *split_params(p, quant), quant

    def dequantize(self, dtype=torch.float32):
        """Dense ``(k, v)`` ``[batch, kv_heads, max_tokens, D]``; tokens past a length are zero."""
        positions = torch.arange(self.max_tokens, device=self.lengths.device)
        valid = (positions[None, :] < self.lengths[:, None].long())[:, None, :, None]
        out = []
        for role in ("k", "v"):
            codes, scale, offset, quant = self.codes_and_params(role)
            out.append(torch.where(valid.to(codes.device), dequantize_groups(codes, scale, offset, quant, dtype), 0))
        return tuple(out)

    def shuffle_pages(self, generator: torch.Generator | None = None) -> "QuantizedKV":
        """The same cache with its pages stored in a random order (page table remapped)."""
        num_pages = self.k_codes.shape[0]
        perm = torch.randperm(num_pages, generator=generator).to(self.k_codes.device)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(num_pages, device=perm.device)
        return replace(
            self,
            k_codes=self.k_codes[perm],
            k_params=self.k_params[perm],
            v_codes=self.v_codes[perm],
            v_params=self.v_params[perm],
            page_table=inverse[self.page_table.long()].to(torch.int32),
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_codes, self.k_params, self.v_codes, self.v_params))


def _check_kv(name, x, scheme):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != scheme.q_dtype:
        raise TypeError(f"{name} must have dtype {scheme.q_dtype} (Scheme.q_dtype), got {x.dtype}")
    if x.dim() != 4 or x.shape[-1] != scheme.head_dim:
        raise ValueError(f"{name} must have shape [batch, kv_heads, tokens, {scheme.head_dim}], got {tuple(x.shape)}")
    if x.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor (a shape without data): quantizing needs its values")
    if x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"{name} must hold at least one sequence and one KV head, got shape {tuple(x.shape)}")


def quantize_kv(k, v, scheme: Scheme, page_size: int | None = None, lengths=None,
                layout: str = "hopper") -> QuantizedKV:
    """Quantize dense ``k, v [batch, kv_heads, tokens, head_dim]`` into a paged cache.

    ``page_size``: tokens per page, default the smallest that holds the scheme's channel-wise
    groups (:func:`smallest_page_size`: 64, or 128 for a channel-wise group of 128).

    ``lengths`` (int tensor ``[batch]``, default: all ``tokens``) marks each sequence's valid
    prefix. Sequence ``b`` gets pages ``b*max_pages ... (b+1)*max_pages - 1`` (identity page table);
    :meth:`QuantizedKV.shuffle_pages` scatters them. ``layout`` is the bit order inside a tile,
    "hopper" or "blackwell" (the arch whose kernel will read the cache).
    """
    if layout not in PACKERS:
        raise ValueError(f"layout must be one of {sorted(PACKERS)}, got {layout!r}")
    if not isinstance(scheme, Scheme):
        raise TypeError(f"scheme must be a foscar.Scheme, got {type(scheme).__name__}")
    _check_kv("k", k, scheme)
    _check_kv("v", v, scheme)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.device != v.device:
        raise ValueError(f"k and v must be on one device, got {k.device} and {v.device}")
    page_size = check_page_size(scheme, smallest_page_size(scheme) if page_size is None else page_size)
    batch, kv_heads, tokens, dim = k.shape
    if tokens < 1:
        raise ValueError("k and v must hold at least one token")
    if lengths is None:
        lengths = torch.full((batch,), tokens, dtype=torch.int32, device=k.device)
    if (not isinstance(lengths, torch.Tensor) or lengths.shape != (batch,) or lengths.dtype.is_floating_point
            or lengths.dtype.is_complex or lengths.dtype == torch.bool):
        raise ValueError(f"lengths must be an integer tensor of shape [{batch}], got " + (
            f"{lengths.dtype} of shape {list(lengths.shape)}" if isinstance(lengths, torch.Tensor)
            else type(lengths).__name__))
    if lengths.min() < 1 or lengths.max() > tokens:
        raise ValueError(f"lengths must lie in [1, {tokens}], got [{int(lengths.min())}, {int(lengths.max())}]")
    lengths = lengths.to(device=k.device, dtype=torch.int32)
    max_pages = -(-tokens // page_size)
    padded = max_pages * page_size
    valid = torch.arange(padded, device=k.device)[None, :] < lengths[:, None]
    valid = valid[:, None, :].expand(batch, kv_heads, padded)
    fields = {}
    for role, x, quant in (("k", k, scheme.k), ("v", v, scheme.v)):
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - tokens))
        codes, scale, offset = quantize_groups(x, quant, valid, name=role)
        geom = TileGeometry(role, quant.bits, dim)
        tiles = codes.reshape(batch, kv_heads, max_pages, page_size // TILE_TOKENS, TILE_TOKENS, dim)
        words = PACKERS[layout][0](tiles, geom).permute(0, 2, 1, 3, 4)  # [batch, max_pages, kvh, tiles, words]
        params = stack_params(scale, offset, quant)  # [batch, kvh, rows, cols, param_fields]
        rows_per_page = params.shape[2] // max_pages
        params = params.reshape(batch, kv_heads, max_pages, rows_per_page, *params.shape[3:]).permute(0, 2, 1, 3, 4, 5)
        fields[f"{role}_codes"] = words.reshape(batch * max_pages, kv_heads, *words.shape[3:]).contiguous()
        fields[f"{role}_params"] = params.reshape(batch * max_pages, kv_heads, *params.shape[3:]).contiguous()
    page_table = torch.arange(batch * max_pages, dtype=torch.int32, device=k.device).reshape(batch, max_pages)
    return QuantizedKV(scheme, page_size, page_table=page_table, lengths=lengths, layout=layout, **fields)

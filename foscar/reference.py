"""Dense references for decode attention over a :class:`~foscar.quantize.QuantizedKV` cache.

* :func:`attend_dequantized` -- dequantize, then attend, in float64: the ground truth.
* :func:`attend_folded` -- executes a :class:`~foscar.scheme.FoldingPlan` in float64: MMA partial
  sums over *operand values* built from codes (``a*c + b``, the construction), scales on the other
  operand or on the partial sums, offset corrections (with the construction bias folded in), and
  tile-by-tile online softmax as the kernels do it. Equal to the ground truth up to float64
  rounding: the proof that the algebra the kernels implement is exact.
* :func:`attend_dequantized_torch` -- what a PyTorch user would run in BF16 (dequantize, SDPA);
  its error against the ground truth sets the kernels' tolerance.

Query ``q`` is ``[batch, q_heads, head_dim]`` with ``q_heads = kv_heads * gqa_ratio``; query head
``h`` reads KV head ``h // gqa_ratio``. Outputs: ``out [batch, q_heads, head_dim]`` and
``lse [batch, q_heads]`` (natural log of the sum of ``exp(sm_scale * q.k)``).
"""

from __future__ import annotations

import math

import torch

LOG2E = math.log2(math.e)

from .layouts import TILE_TOKENS
from .quantize import QuantizedKV
from .scheme import Axis, Construction, Correction, Site

__all__ = ["attend_dequantized", "attend_folded", "attend_dequantized_torch", "check_query"]


def check_query(q: torch.Tensor, cache: QuantizedKV, sm_scale) -> None:
    """Validate ``q`` against ``cache`` with errors that name the argument."""
    scheme = cache.scheme
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype != scheme.q_dtype:
        raise TypeError(f"q must have dtype {scheme.q_dtype} (Scheme.q_dtype), got {q.dtype}")
    expected = (cache.batch, cache.kv_heads * scheme.gqa_ratio, scheme.head_dim)
    if tuple(q.shape) != expected:
        raise ValueError(f"q must have shape [batch, kv_heads*gqa_ratio, head_dim] = {list(expected)}, got {list(q.shape)}")
    if not isinstance(sm_scale, (int, float)) or isinstance(sm_scale, bool) or not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a positive finite float, got {sm_scale!r}")


def _grouped_query(q, cache):
    batch = cache.batch
    return q.to(torch.float64).reshape(batch, cache.kv_heads, cache.scheme.gqa_ratio, cache.scheme.head_dim)


def attend_dequantized(q, cache: QuantizedKV, sm_scale: float):
    """Ground truth: dequantize the cache in float64, then softmax attention."""
    check_query(q, cache, sm_scale)
    k, v = cache.dequantize(torch.float64)
    qg = _grouped_query(q, cache).to(k.device)
    scores = torch.einsum("bhrd,bhld->bhrl", qg, k) * sm_scale
    valid = torch.arange(cache.max_tokens, device=k.device)[None, :] < cache.lengths[:, None].to(k.device)
    scores = scores.masked_fill(~valid[:, None, None, :], -torch.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhrl,bhld->bhrd", torch.exp(scores - lse[..., None]), v)
    return out.reshape(q.shape), lse.reshape(q.shape[:2])


def _expand(params, axis, group, tokens, dim):
    """Per-element view ``[batch, kvh, tokens, dim]`` of per-group params (for indexing only)."""
    if axis is Axis.TOKEN:
        return params.repeat_interleave(group, dim=-1)[..., :tokens, :dim]
    return params.repeat_interleave(group, dim=-2)[..., :tokens, :dim]


def attend_folded(q, cache: QuantizedKV, sm_scale: float, construction: Construction | None = None, tile: int = TILE_TOKENS,
                  operand_dtype: torch.dtype | None = None):
    """Execute the folding plan of ``cache.scheme`` (for ``construction``) in float64.

    ``operand_dtype`` (e.g. ``torch.float16``) additionally emulates the Hopper kernel's one rounding
    step: the MMA's other operand (Q, Q*s', P or P*s', scaled as the kernel scales it) is rounded to
    that type; the offset corrections take the unrounded q or p, as the kernel does (the operand bias
    cancels inside the MMA accumulator, ``foscar.operands``); everything else stays exact.
    """
    check_query(q, cache, sm_scale)
    rnd = (lambda x: x) if operand_dtype is None else (lambda x: x.to(operand_dtype).to(torch.float64))
    log2_scale = sm_scale * LOG2E  # the kernel folds the softmax scale into Q*s' (log2 domain)
    plan = cache.scheme.plan(construction)
    con = plan.construction
    dim = cache.scheme.head_dim
    qg = _grouped_query(q, cache)  # [b, h, r, d]
    batch, kvh, ratio, _ = qg.shape
    m = torch.full((batch, kvh, ratio), -torch.inf, dtype=torch.float64)
    denom = torch.zeros_like(m)
    acc = torch.zeros_like(qg)
    k_codes, k_s, k_z, _ = cache.codes_and_params("k")
    v_codes, v_s, v_z, _ = cache.codes_and_params("v")
    k_op, v_op = con.operand(k_codes), con.operand(v_codes)  # MMA operand values
    k_s, k_z = con.fold_scale(k_s.double()), con.fold_offset(k_s.double(), k_z.double())
    v_s, v_z = con.fold_scale(v_s.double()), con.fold_offset(v_s.double(), v_z.double())
    lengths = cache.lengths.long().cpu()
    for start in range(0, int(lengths.max()), tile):
        stop = start + tile
        sl = slice(start, stop)
        valid = (torch.arange(start, stop)[None, :] < lengths[:, None])[:, None, None, :]  # [b,1,1,l]
        # ---- S = q . k over the tile, folded (design.md table, rows K token-/channel-wise)
        kop = k_op[:, :, sl]  # [b, h, l, d]
        if plan.k.scale_site is Site.PARTIAL_SUM:  # K token-wise: one accumulator per channel block
            g = plan.k.block
            q_mma = rnd(qg).reshape(batch, kvh, ratio, dim // g, g)
            blocks = torch.einsum("bhrjd,bhljd->bhrlj", q_mma, kop.reshape(*kop.shape[:3], dim // g, g))
            scores = torch.einsum("bhrlj,bhlj->bhrl", blocks, k_s[:, :, sl])
            assert plan.k.correction is Correction.OFFSET_TIMES_QSUM
            qsum = qg.reshape(batch, kvh, ratio, dim // g, g).sum(-1)  # [b,h,r,j]
            scores = (scores + torch.einsum("bhlj,bhrj->bhrl", k_z[:, :, sl], qsum)) * sm_scale
        else:  # K channel-wise: Q scaled per token block t before the MMA
            g = plan.k.block
            s_tok = _expand(k_s, Axis.CHANNEL, g, k_op.shape[2], dim)[:, :, sl] * log2_scale  # [b,h,l,d]
            z_tok = _expand(k_z, Axis.CHANNEL, g, k_op.shape[2], dim)[:, :, sl] * log2_scale
            q_scaled = rnd(qg[:, :, :, None, :] * s_tok[:, :, None])  # [b,h,r,l,d]: one scaled Q per token block
            scores = torch.einsum("bhrld,bhld->bhrl", q_scaled, kop)
            assert plan.k.correction is Correction.Q_DOT_OFFSET
            corr = (qg[:, :, :, None, :] * z_tok[:, :, None]).sum(-1)
            scores = (scores + corr) / LOG2E
        scores = torch.where(valid, scores, -torch.inf)
        # ---- online softmax
        m_new = torch.maximum(m, scores.amax(-1))
        alpha = torch.exp(m - m_new).nan_to_num(0.0)
        p = torch.exp(scores - m_new[..., None])  # [b,h,r,l]
        denom = denom * alpha + p.sum(-1)
        # ---- O += P . v over the tile, folded (rows V token-/channel-wise)
        vop = v_op[:, :, sl]  # [b,h,l,d]
        if plan.v.scale_site is Site.OTHER_OPERAND:  # V token-wise: P scaled per channel block j
            g = plan.v.block
            s_el = _expand(v_s, Axis.TOKEN, g, v_op.shape[2], dim)[:, :, sl]  # [b,h,l,d]
            z_el = _expand(v_z, Axis.TOKEN, g, v_op.shape[2], dim)[:, :, sl]
            p_scaled = rnd(p[..., None] * s_el[:, :, None])  # [b,h,r,l,d]: one scaled P per channel block
            pv = torch.einsum("bhrld,bhld->bhrd", p_scaled, vop)
            assert plan.v.correction is Correction.P_DOT_OFFSET
            corr = (p[..., None] * z_el[:, :, None]).sum(-2)
        else:  # V channel-wise: one partial sum per token block t, scaled after the MMA
            sub = min(plan.v.block, tile)  # a tile holds whole groups, or lies inside one
            blocks = tile // sub
            group_of_block = torch.arange(start, stop, sub) // plan.v.block
            p_blocks = rnd(p).reshape(batch, kvh, ratio, blocks, sub)
            partial = torch.einsum("bhrtl,bhtld->bhrtd", p_blocks, vop.reshape(batch, kvh, blocks, sub, dim))
            pv = torch.einsum("bhrtd,bhtd->bhrd", partial, v_s[:, :, group_of_block])
            assert plan.v.correction is Correction.OFFSET_TIMES_PSUM
            psum = p.reshape(batch, kvh, ratio, blocks, sub).sum(-1)
            corr = torch.einsum("bhrt,bhtd->bhrd", psum, v_z[:, :, group_of_block])
        acc = acc * alpha[..., None] + pv + corr
        m = m_new
    out = acc / denom[..., None]
    lse = m + torch.log(denom)
    return out.reshape(q.shape), lse.reshape(q.shape[:2])


def attend_dequantized_torch(q, cache: QuantizedKV, sm_scale: float, dtype=torch.bfloat16):
    """What a PyTorch user would compute: dequantize to ``dtype``, then SDPA in ``dtype``."""
    check_query(q, cache, sm_scale)
    k, v = (t.to(dtype) for t in cache.dequantize(torch.float32))
    valid = torch.arange(cache.max_tokens, device=k.device)[None, :] < cache.lengths[:, None].to(k.device)
    qd = q.to(dtype=dtype, device=k.device)[:, :, None, :]  # [b, hq, 1, d]
    out = torch.nn.functional.scaled_dot_product_attention(
        qd, k, v, attn_mask=valid[:, None, None, :], scale=sm_scale, enable_gqa=True
    )
    return out[:, :, 0, :]

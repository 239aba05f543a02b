"""Dense references for decode attention over a :class:`~foscar.quantize.QuantizedKV` cache.

* :func:`attend_dequantized` -- dequantize, then attend, in float64: the ground truth.
* :func:`attend_folded` -- executes a :class:`~foscar.scheme.FoldingPlan` (its fold cases) in float64: MMA partial
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

import torch

from .checks import LOG2E, checked_sm_scale
from .formats import affine_mismatch
from .layouts import TILE_TOKENS
from .quantize import QuantizedKV
from .scheme import Construction

__all__ = ["attend_dequantized", "attend_folded", "attend_dequantized_torch", "check_query"]


def check_query(q: torch.Tensor, cache: QuantizedKV, sm_scale) -> float:
    """Validate ``q`` against ``cache`` with errors that name the argument; returns ``sm_scale`` as a float."""
    scheme = cache.scheme
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype != scheme.q_dtype:
        raise TypeError(f"q must have dtype {scheme.q_dtype} (Scheme.q_dtype), got {q.dtype}")
    expected = (cache.batch, cache.kv_heads * scheme.gqa_ratio, scheme.head_dim)
    if tuple(q.shape) != expected:
        raise ValueError(f"q must have shape [batch, kv_heads*gqa_ratio, head_dim] = {list(expected)}, got {list(q.shape)}")
    return checked_sm_scale(sm_scale)


def _grouped_query(q, cache):
    batch = cache.batch
    return q.to(torch.float64).reshape(batch, cache.kv_heads, cache.scheme.gqa_ratio, cache.scheme.head_dim)


def attend_dequantized(q, cache: QuantizedKV, sm_scale: float):
    """Ground truth: dequantize the cache in float64, then softmax attention."""
    sm_scale = check_query(q, cache, sm_scale)
    k, v = cache.dequantize(torch.float64)
    qg = _grouped_query(q, cache).to(k.device)
    scores = torch.einsum("bhrd,bhld->bhrl", qg, k) * sm_scale
    valid = torch.arange(cache.max_tokens, device=k.device)[None, :] < cache.lengths[:, None].to(k.device)
    scores = scores.masked_fill(~valid[:, None, None, :], -torch.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhrl,bhld->bhrd", torch.exp(scores - lse[..., None]), v)
    return out.reshape(q.shape), lse.reshape(q.shape[:2])


def attend_folded(q, cache: QuantizedKV, sm_scale: float, arch: str = "sm_90a", tile: int = TILE_TOKENS,
                  operand_dtype: torch.dtype | None = None, construction: Construction | None = None):
    """Execute the folding plan of ``cache.scheme`` for ``arch`` in float64, tile by tile: each
    tensor's fold case (``foscar.folds``) computes its slice -- the scores of a tile for K, the
    folded P.v and its offset correction for V -- over *operand values* ``a*c + b`` of that arch's
    construction (``construction`` overrides it for both tensors).

    ``operand_dtype`` (e.g. ``torch.float16``) additionally emulates the Hopper kernel's one rounding
    step: the MMA's other operand (Q, Q*s', P or P*s', scaled as the kernel scales it) is rounded to
    that type; the offset corrections take the unrounded q or p, as the kernel does (the operand bias
    cancels inside the MMA accumulator, ``foscar.operands``); everything else stays exact. A format whose
    ``dequantize`` is not ``scale * code + offset`` (``foscar.formats.affine_mismatch``) is refused.
    """
    sm_scale = check_query(q, cache, sm_scale)
    for name, quant in (("k", cache.scheme.k), ("v", cache.scheme.v)):
        reason = affine_mismatch(quant.format)
        if reason is not None:  # the folds take scale * code + offset; attend_dequantized takes any format
            raise ValueError(f"{name}: a format the folds cannot take: {reason}")
    rnd = (lambda x: x) if operand_dtype is None else (lambda x: x.to(operand_dtype).to(torch.float64))
    plan = cache.scheme.plan(arch, construction=construction)
    qg = _grouped_query(q, cache)  # [b, h, r, d]
    batch, kvh, ratio, _ = qg.shape
    m = torch.full((batch, kvh, ratio), -torch.inf, dtype=torch.float64)
    denom = torch.zeros_like(m)
    acc = torch.zeros_like(qg)
    folded = {}
    for fold in (plan.k, plan.v):
        codes, s, z, _ = cache.codes_and_params(fold.tensor)
        con = fold.construction
        s, z = s.double(), fold.offsets(s.double(), None if z is None else z.double())
        folded[fold.tensor] = (con.operand(codes), con.fold_scale(s), con.fold_offset(s, z))
    k_op, k_s, k_z = folded["k"]
    v_op, v_s, v_z = folded["v"]
    lengths = cache.lengths.long().cpu()
    for start in range(0, int(lengths.max()), tile):
        sl = slice(start, start + tile)
        valid = (torch.arange(start, start + tile)[None, :] < lengths[:, None])[:, None, None, :]  # [b,1,1,l]
        scores = plan.k.scores(qg, k_op[:, :, sl], k_s, k_z, sl, sm_scale, LOG2E, rnd)
        scores = torch.where(valid, scores, -torch.inf)
        # ---- online softmax
        m_new = torch.maximum(m, scores.amax(-1))
        alpha = torch.exp(m - m_new).nan_to_num(0.0)
        p = torch.exp(scores - m_new[..., None])  # [b,h,r,l]
        denom = denom * alpha + p.sum(-1)
        pv, corr = plan.v.output(p, v_op[:, :, sl], v_s, v_z, start, tile, rnd)
        acc = acc * alpha[..., None] + pv + corr
        m = m_new
    out = acc / denom[..., None]
    lse = m + torch.log(denom)
    return out.reshape(q.shape), lse.reshape(q.shape[:2])


def attend_dequantized_torch(q, cache: QuantizedKV, sm_scale: float, dtype=torch.bfloat16):
    """What a PyTorch user would compute: dequantize to ``dtype``, then SDPA in ``dtype``."""
    sm_scale = check_query(q, cache, sm_scale)
    k, v = (t.to(dtype) for t in cache.dequantize(torch.float32))
    valid = torch.arange(cache.max_tokens, device=k.device)[None, :] < cache.lengths[:, None].to(k.device)
    qd = q.to(dtype=dtype, device=k.device)[:, :, None, :]  # [b, hq, 1, d]
    out = torch.nn.functional.scaled_dot_product_attention(
        qd, k, v, attn_mask=valid[:, None, None, :], scale=sm_scale, enable_gqa=True
    )
    return out[:, :, 0, :]

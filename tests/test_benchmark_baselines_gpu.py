"""benchmarks/decode.py's FlashInfer XQA baseline on a GPU: the call it times attends over the cache it was given
(HND pages, K and V of a page in one buffer, the last page part-full), not over a misread of it. XQA rounds Q and P
to e4m3 on the H200, so the check is a relative error (a misread layout or scale is off by ~100%)."""

import pytest
import torch

from benchmarks import decode as bench

pytestmark = pytest.mark.gpu


def _reference(fi, context, kv_heads):
    """FP32 attention of ``fi.q`` over ``fi.cache`` (pages of ``bench.XQA_PAGE``, sequence b on pages
    b * pages ... (b + 1) * pages - 1)."""
    batch, q_heads, head_dim = fi.q.shape
    kv = fi.cache.float().view(batch, -1, 2, kv_heads, bench.XQA_PAGE, head_dim)  # [b, page, k|v, h, token, d]
    kv = kv.permute(0, 2, 3, 1, 4, 5).reshape(batch, 2, kv_heads, -1, head_dim)[:, :, :, :context]
    k, v = (t.repeat_interleave(q_heads // kv_heads, dim=1) for t in kv.unbind(1))
    scores = torch.einsum("bhd,bhtd->bht", fi.q.float(), k) * head_dim**-0.5
    return torch.einsum("bht,bhtd->bhd", scores.softmax(-1), v)


@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(32, 8, 128), (16, 4, 256)])
def test_xqa_baseline_attends_over_its_cache(q_heads, kv_heads, head_dim):
    flashinfer = pytest.importorskip("flashinfer")
    try:
        bench.xqa_decode_of(flashinfer)
    except ImportError as exc:
        pytest.skip(str(exc))
    context = 1000  # 16 pages of 64, the last one part-full
    fi = bench.FlashInferXQADecode(3, context, q_heads, kv_heads, head_dim)
    fi()
    ref = _reference(fi, context, kv_heads)
    error = ((fi.out.float() - ref).norm() / ref.norm()).item()
    assert error < 0.1, f"{fi.path}: relative error {error:.3f}"
    other = fi.cache.clone()
    other[:, 1] = torch.randn(other[:, 1].shape, device="cuda").to(other.dtype)  # new V: a new output
    fi(other)
    assert ((fi.out.float() - ref).norm() / ref.norm()).item() > 0.5

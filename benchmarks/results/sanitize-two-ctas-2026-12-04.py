"""One-off: unsplit short-context decodes into NaN-poisoned outputs against float64, to run under compute-sanitizer.

As run on 2026-12-04 it called ``check_decode``, whose ``decode`` planned 2 splits for this batch, so the launches it
sanitized were split launches (2 consumer warpgroups), not the two-CTA kernel (benchmarks/NOTES.md section 42). This
version forces one split, where ``launch_options`` takes two CTAs per SM (160 sequences x 2 KV heads: 2.4 waves on
132 SMs); not run yet."""
import torch

from foscar import Scheme
from foscar.decode import decode
from foscar.hopper.decode import KERNELS
from foscar.launch import sm_waves
from foscar.testing import check_output, random_problem

for scheme in (Scheme.make(2, "token", 128, "token", 128, 128, 4), Scheme.make(4, "token", 128, "token", 128, 128, 4)):
    q, cache = random_problem(scheme, [1, 65, 1000, 2049] * 40, kv_heads=2, page_size=128)
    capacity = cache.page_table.shape[1] * 128
    assert KERNELS.launch_options(scheme, 1, capacity, 1, sm_waves(q.device, q.shape[0] * 2)) == {
        "consumers": 1, "ctas_per_sm": 2}
    out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("nan"), device=q.device)
    decode(q, cache, return_lse=True, num_splits=1, out=out, lse=lse)
    acc = check_output(out, lse, q, cache, scheme.head_dim**-0.5)
    print(scheme.name, "two CTAs per SM", acc, "ok" if acc.ok else "FAILED", flush=True)

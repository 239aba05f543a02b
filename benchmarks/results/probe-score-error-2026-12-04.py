"""The Hopper decode's score and lse error against float64, several ``foscar`` packages side by side (one-off probe).

    python benchmarks/results/probe-score-error-2026-12-04.py <dir>/foscar,worktree [int2-kt128,...]

A sequence of one token has ``lse = sm_scale * q.k`` exactly, so its lse error is the kernel's score error (the
operand bias cancellation in the FP32 accumulator, ``foscar.operands``); 4K-token sequences give the lse and output
errors a test sees. Each row beside the same attention in torch at q's dtype (``attend_dequantized_torch``: the
tolerance rule's yardstick). Fresh random inputs (``foscar.testing.random_problem``), NaN-poisoned outputs.
"""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.ab import decode_call, load  # noqa: E402

import foscar  # noqa: E402
from foscar.reference import attend_dequantized, attend_dequantized_torch  # noqa: E402
from foscar.testing import random_problem  # noqa: E402

CASES = {"1 token": ([1] * 1024, 8), "4K tokens": ([4096] * 32, 8)}


def scheme(pkg, method, dtype):
    bits, axis, group = int(method[3]), {"t": "token", "c": "channel"}[method[6]], int(method[7:])
    return pkg.Scheme.make(bits, axis, group, "token", 128, 128, 4, q_dtype=dtype)


def main():
    revs = sys.argv[1].split(",")
    methods = sys.argv[2].split(",") if len(sys.argv) > 2 else ["int2-kt128", "int4-kt128", "int2-kc128", "int4-kc128"]
    packages = load(revs, Path(tempfile.mkdtemp()))
    rows = []
    for method in methods:
        for dtype in (torch.float16, torch.bfloat16):
            for case, (lengths, kv_heads) in CASES.items():
                q, cache = random_problem(scheme(foscar, method, dtype), lengths, kv_heads=kv_heads, page_size=128)
                ref, ref_lse = attend_dequantized(q, cache, 0.1)
                low = attend_dequantized_torch(q, cache, 0.1, dtype=dtype)
                low_err = float((low.double() - ref).abs().max())
                for rev, pkg in zip(revs, packages):
                    out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("nan"), device=q.device)
                    decode_call(pkg, scheme(pkg, method, dtype), q, cache, 1, sm_scale=0.1, return_lse=True, out=out,
                                lse=lse)
                    d = lse.double() - ref_lse
                    rows.append((method, str(dtype)[6:], case, rev.split("/")[-2] if "/" in rev else rev,
                                 float(d.abs().mean()), float(d.mean()), float(d.abs().max()),
                                 float((out.double() - ref).abs().max()), low_err))
                    print(*rows[-1], flush=True)
    print("\n| method | q | case | package | lse err mean | lse err mean (signed) | lse err max | out err max | "
          "torch out err max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(list(r[:4]) + [f"{x:.2e}" for x in r[4:]]) + " |")


if __name__ == "__main__":
    main()

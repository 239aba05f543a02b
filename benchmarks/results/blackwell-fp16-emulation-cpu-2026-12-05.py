# Blackwell decode emulated in float64 (tests/test_blackwell.emulate_kernel) over coverage_matrix("sm_100a"), BF16 and FP16 q, 3 draws each:
# python benchmarks/results/blackwell-fp16-emulation-cpu-2026-12-05.py  (CPU; output columns: scheme, q dtype, seed, max|out-ref|, tol (2x the q-dtype torch error + 1e-3 floor), max|lse-ref|, within the rule)
import sys, dataclasses, torch
sys.path.insert(0, "tests")
from test_blackwell import emulate_kernel
from foscar.testing import random_problem, check_output, coverage_matrix
rows = []
mat = coverage_matrix("sm_100a")
seen = set()
for scheme, ps, lengths in mat:
    if scheme.name in seen: continue
    seen.add(scheme.name)
    for dt in (torch.bfloat16, torch.float16):
        s = dataclasses.replace(scheme, q_dtype=dt)
        for seed in range(3):
            torch.manual_seed(seed)
            q, cache = random_problem(s, (700, 1500), page_size=ps, device="cpu", layout="blackwell", shuffle=False)
            sm = s.head_dim ** -0.5
            out, lse = emulate_kernel(q, cache, sm)
            out = out.to(dt).reshape(q.shape)
            acc = check_output(out, lse, q, cache, sm)
            rows.append((s.name, str(dt)[6:], seed, acc.err, acc.tol, acc.lse_err, acc.ok))
            print(f"{s.name:40s} {str(dt)[6:]:9s} {seed} err {acc.err:.2e} tol {acc.tol:.2e} lse {acc.lse_err:.2e} {'ok' if acc.ok else 'FAIL'}", flush=True)

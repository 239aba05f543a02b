"""The decode kernel's error against float64 on the H200, for one foscar tree (argv[1]: a directory holding a
``foscar`` package, or ``worktree``): max over 6 fresh problems (seeded 0..5) of the output and lse errors, beside the
same attention computed in q's dtype by PyTorch (the tolerance rule's yardstick), for K channel-wise and token-wise
schemes, one query token (``check_decode``) and 16 tokens per sequence (``check_causal_output``). One-off probe of the
centred codes (benchmarks/NOTES.md section 46), run from the project root."""
import sys
tree = sys.argv[1]
sys.path.insert(0, ".")
if tree != "worktree":
    sys.path.insert(0, tree)
import torch
import foscar
from foscar import Scheme
from foscar.decode import decode
from foscar.testing import check_causal_output, check_output, random_problem
assert foscar.__file__.startswith(tree if tree != "worktree" else "/"), foscar.__file__
CASES = [  # name, scheme, lengths, query tokens
    ("int2-kc128 vt fp16", Scheme.make(2, "channel", 128, "token", 128, 128, 4, torch.float16), (65, 1000, 4097), 1),
    ("int2-kc128 vt bf16", Scheme.make(2, "channel", 128, "token", 128, 128, 4), (65, 1000, 4097), 1),
    ("int4-kc128 vt fp16", Scheme.make(4, "channel", 128, "token", 128, 128, 4, torch.float16), (65, 1000, 4097), 1),
    ("int2-kt128 vt bf16", Scheme.make(2, "token", 128, "token", 128, 128, 4), (65, 1000, 4097), 1),
    ("int4-kt128 vt bf16", Scheme.make(4, "token", 128, "token", 128, 128, 4), (65, 1000, 4097), 1),
    ("int2-kc128 vc d64 gqa1 fp16", Scheme.make(2, "channel", 128, "channel", 128, 64, 1, torch.float16), (257, 20), 16),
]
for name, scheme, lengths, tokens in CASES:
    worst = None
    for seed in range(6):
        gen = torch.Generator("cuda").manual_seed(seed)
        q, cache = random_problem(scheme, list(lengths), kv_heads=2, page_size=128, generator=gen)
        if tokens > 1:
            q = torch.randn(len(lengths), tokens, *q.shape[1:], generator=gen, device="cuda").to(q.dtype)
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:-1], float("nan"), device="cuda")
        decode(q, cache, return_lse=True, out=out, lse=lse)
        sm = scheme.head_dim**-0.5
        acc = check_causal_output(out, lse, q, cache, sm) if tokens > 1 else check_output(out, lse, q, cache, sm)
        worst = acc if worst is None or acc.lse_err > worst.lse_err else worst
        print(f"{tree:>16s} | {name:28s} | seed {seed} | out {acc.err:.2e} | lse {acc.lse_err:.2e} | torch {acc.bf16_err:.2e}")

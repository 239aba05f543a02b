"""The chunk's own causal attention with K/V heads broadcast (stride 0) over the KV heads as batch: bitwise equal to
repeat_interleave's copies?"""
import time
import torch
from foscar.chunk_attention import fused_attention

for L, kv, group, d in ((16, 8, 4, 128), (13, 8, 4, 128), (128, 8, 4, 128), (1024, 8, 4, 128), (100, 1, 8, 128),
                        (64, 4, 2, 64), (300, 2, 7, 256)):
    g = torch.Generator("cuda").manual_seed(L)
    q = torch.randn(L, kv * group, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(kv, L, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    q_by_head = q.transpose(0, 1).contiguous()
    def copies():
        ok, ov = (x.repeat_interleave(group, dim=0)[None] for x in (k, v))
        return fused_attention(q_by_head[None], ok, ov, d ** -0.5, causal=True)
    def broadcast():
        bk, bv = (x[:, None].expand(kv, group, L, d) for x in (k, v))
        out, lse = fused_attention(q_by_head.view(kv, group, L, d), bk, bv, d ** -0.5, causal=True)
        return out.reshape(1, kv * group, L, d), lse.reshape(1, kv * group, L)
    a, b = copies(), broadcast()
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    ts = {}
    for name, f in (("copies", copies), ("broadcast", broadcast)):
        for _ in range(3): f()
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(50): f()
        ts[name] = (time.perf_counter() - t) / 50 * 1e6; torch.cuda.synchronize()
    print(f"L {L} kv {kv} group {group} d {d}: bitwise equal {same}, max diff "
          f"{max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b)):.3g}; host us copies "
          f"{ts['copies']:.0f} broadcast {ts['broadcast']:.0f}", flush=True)

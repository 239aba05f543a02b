"""One-off: attend_chunk at chunk 1024 over a 100K INT2 kc128 prefix: GPU time per aten op, host time per function."""
import cProfile, pstats, io
import torch
from benchmarks.decode import MODELS, scheme_of
from benchmarks.extend import foscar_prefix

q_heads, kv_heads, d = MODELS["qwen3-8b"]
gen = torch.Generator("cuda").manual_seed(0)
cache, seq = foscar_prefix(scheme_of("int2-kc128"), kv_heads, 100000, gen)
chunk = 1024
q = torch.randn(chunk, q_heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
k_new = torch.randn(kv_heads, chunk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
v_new = torch.randn_like(k_new)
fo = lambda: cache.attend_chunk(0, [seq], q[None], k_new[None], v_new[None])
for _ in range(4):
    fo()
torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
    fo(); torch.cuda.synchronize()
print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=45, max_shapes_column_width=70))
pr = cProfile.Profile()
torch.cuda.synchronize()
pr.enable()
for _ in range(5):
    fo()
pr.disable()
torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(35); print(s.getvalue()[:9000])
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000])

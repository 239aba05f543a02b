"""benchmarks/serve.py on a GPU: a CUDA-graph replay of the whole decode step does what an eager step
does (the same greedy tokens every step, the same cache afterwards), per KV format. The geometry has
Qwen3-8B's attention shape (head_dim 128, 4 query heads per KV head), so the kernels are those the
benchmark compiles."""

import pytest
import torch

from benchmarks import serve

pytestmark = pytest.mark.gpu

GEOMETRY = serve.Geometry("gpu-test", layers=2, hidden=512, q_heads=8, kv_heads=2, head_dim=128, mlp=1024, vocab=2048)
CONTEXT, STEPS = 600, 70  # 70 steps: the oldest window tile is quantized inside the graph at least once


@pytest.mark.parametrize("name", ["int4", "int2", "k4v2", "int2-kivi", "bf16", "fp8", "fp8-xqa"])
def test_graph_replay_equals_eager_steps(name, rng):
    fmt = serve.FORMATS[name]
    cls = serve.BACKENDS[fmt.backend]
    dev = torch.device("cuda", torch.cuda.current_device())
    try:
        cls.check(dev)
    except serve.FormatMissing as exc:
        pytest.skip(str(exc))
    seeds = torch.randint(0, 2**31, (2,), generator=rng).tolist()
    model = serve.Decoder(GEOMETRY, dev, seed=seeds[0])
    graphed, eager = (
        serve.DecodeLoop(model, cls(GEOMETRY, fmt, 3, CONTEXT, CONTEXT + 2 * STEPS, dev,
                                    torch.Generator(dev).manual_seed(seeds[1])),
                         2, CONTEXT, torch.Generator(dev).manual_seed(seeds[1]))
        for _ in range(2))
    assert torch.equal(graphed.tokens, eager.tokens)
    graphed.capture()  # one eager step, then the capture
    eager.step()
    assert torch.equal(graphed.tokens, eager.tokens)
    for step in range(STEPS):
        graphed.graph.replay()
        eager.step()
        assert torch.equal(graphed.tokens, eager.tokens), step
    assert torch.equal(graphed.positions, eager.positions)
    if fmt.backend == "foscar":
        for part in ("k_codes", "k_params", "v_codes", "v_params", "k_bf16", "v_bf16", "lengths"):
            assert torch.equal(getattr(graphed.backend.cache, part), getattr(eager.backend.cache, part)), part
        assert (graphed.backend.cache.lengths[:, :2] == CONTEXT + 1 + STEPS).all()
    else:
        assert torch.equal(graphed.backend.kv.view(torch.uint8), eager.backend.kv.view(torch.uint8))

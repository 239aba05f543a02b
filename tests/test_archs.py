"""The arch registry: layouts and constructions per arch, and can_implement refusing what a kernel
cannot build -- naming the field, before anything compiles."""

import functools

import pytest
import torch

import foscar.jit as jit
from foscar.archs import ARCHS, BLACKWELL, HOPPER, arch_of_device, get_arch
from foscar.jit import kernel_count
from foscar.layouts import PACKERS
from foscar.scheme import Scheme, TensorQuant, construction_for


def test_registry_names_layouts_and_constructions():
    assert sorted(ARCHS) == ["sm_100a", "sm_90a"] and ARCHS["sm_90a"] is HOPPER and ARCHS["sm_100a"] is BLACKWELL
    assert (HOPPER.layout, BLACKWELL.layout) == ("hopper", "blackwell")
    for arch in ARCHS.values():
        assert arch.layout in PACKERS
        for bits in (2, 4):
            assert arch.construction(bits) is construction_for(arch.name, bits)
            assert Scheme.make(k_bits=bits, v_bits=6 - bits).plan(arch.name).k.construction is arch.construction(bits)
    with pytest.raises(ValueError, match="arch must be one of"):
        get_arch("sm_80")


def _scheme_with_group(group):
    """A scheme whose V group is below what Scheme admits today (32): the kernels' own limit is
    stated apart from Scheme's, so widening Scheme's group sizes cannot slip past it."""
    scheme = Scheme.make(2)
    object.__setattr__(scheme, "v", TensorQuant("token", group, 2))
    return scheme


@pytest.mark.parametrize("arch", ARCHS.values(), ids=lambda a: a.name)
@pytest.mark.parametrize(
    "make, page_size, field",
    [
        (lambda: Scheme.make(2, gqa_ratio=17), 128, "Scheme.gqa_ratio=17"),
        (lambda: Scheme.make(4, gqa_ratio=64), 64, "Scheme.gqa_ratio=64"),  # the references take it, no kernel does
        (lambda: Scheme.make(2), 32, "page_size must be one of"),
        (lambda: Scheme.make(2), 512, "page_size must be one of"),
        (lambda: Scheme.make(2), 128.0, "page_size must be one of"),
        (lambda: Scheme.make(2, k="channel", k_group=128), 64, r"Scheme.k.group=128 \(channel-wise\) must divide page_size=64"),
        (lambda: Scheme.make(4, v="channel", v_group=256, head_dim=256), 128, "Scheme.v.group=256"),
        (lambda: _scheme_with_group(8), 128, "Scheme.v.group=8: .* needs groups of at least"),
    ],
)
def test_can_implement_names_the_field(arch, make, page_size, field):
    with pytest.raises(ValueError, match=field):
        arch.can_implement(make(), page_size)


def test_limits_known_only_from_the_kernel_config_are_translated():
    """Shared memory (Blackwell) and the ring (Hopper) depend on the whole geometry: the config's
    own error is kept, as a ValueError that lists the Scheme fields to change."""
    smem = Scheme.make(2, "channel", 32, "token", 32, head_dim=256, gqa_ratio=9)
    with pytest.raises(ValueError, match=r"sm_100a kernel cannot build it \(.*shared memory\).*Scheme.head_dim"):
        BLACKWELL.can_implement(smem, 128)
    HOPPER.can_implement(smem, 128)  # Hopper builds it
    ring = Scheme.make(4, "channel", 256, "token", 32, head_dim=256)
    with pytest.raises(ValueError, match=r"sm_90a kernel cannot build it \(ring stages.*Scheme.k / Scheme.v"):
        HOPPER.can_implement(ring, 256)
    with pytest.raises(TypeError, match="scheme must be"):
        HOPPER.can_implement("int2", 128)


def test_coverage_schemes_are_implementable():
    """What the compile and GPU tests build must pass, K4V2/K2V4 rows included, on both arches; a
    registered format an arch has no operands for (the INT8 of tests/user_formats.py on Blackwell) is
    refused by name, and only those."""
    from foscar.formats import Unsupported
    from foscar.testing import coverage_matrix

    for scheme, page_size, _ in coverage_matrix():
        for arch in ARCHS.values():
            refused = []
            for quant in (scheme.k, scheme.v):
                try:
                    quant.format.construction(arch.name)
                except Unsupported:
                    refused.append(quant.format.name)
            if refused:
                with pytest.raises(ValueError, match=rf"Scheme\.[kv]\.format: {refused[0]}:"):
                    arch.can_implement(scheme, page_size)
            else:
                arch.can_implement(scheme, page_size)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_refused_variant_compiles_nothing(arch):
    from foscar.decode import compile_decode

    before = kernel_count()
    with pytest.raises(ValueError, match="Scheme.gqa_ratio"):
        compile_decode(Scheme.make(2, gqa_ratio=20), arch)
    with pytest.raises(ValueError, match="Scheme.gqa_ratio"):
        get_arch(arch).compile_decode(Scheme.make(2, gqa_ratio=20), 128, True)
    assert kernel_count() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_and_cache_refuse_a_variant_before_compiling():
    from foscar.cache import PagedKVCache
    from foscar.decode import decode
    from foscar.testing import random_problem

    scheme = Scheme.make(2, gqa_ratio=17)
    q, cache = random_problem(scheme, [100, 7], page_size=128)
    before = kernel_count()
    with pytest.raises(ValueError, match="Scheme.gqa_ratio=17"):
        decode(q, cache)
    with pytest.raises(ValueError, match="Scheme.gqa_ratio=17"):
        PagedKVCache(scheme, 1, 2, 8, 2, 1000, device="cuda")
    if arch_of_device().name != "sm_100a":
        with pytest.raises(ValueError, match="arch=sm_100a: the kernels cannot run on cuda:0"):
            PagedKVCache(Scheme.make(2), 1, 2, 8, 2, 1000, device="cuda", arch="sm_100a")
    assert kernel_count() == before


def _fake_gpu(monkeypatch, capability, name):
    """torch reports one CUDA device of ``capability`` called ``name`` (no GPU needed)."""
    monkeypatch.delenv("FOSCAR_ARCH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(jit, "_cuda_arch", functools.cache(jit._cuda_arch.__wrapped__))  # device_arch's, fresh


@pytest.mark.parametrize("capability, name", [((8, 0), "NVIDIA A100-SXM4-80GB"), ((8, 9), "NVIDIA L40S"),
                                              ((12, 0), "NVIDIA GeForce RTX 5090")])
def test_a_gpu_the_kernels_do_not_run_on_is_named(capability, name, monkeypatch):
    from foscar.cache import PagedKVCache
    from foscar.jit import device_arch

    _fake_gpu(monkeypatch, capability, name)
    sm = f"sm_{capability[0]}{capability[1]}"
    message = rf"{name} \(compute capability {capability[0]}\.{capability[1]}, {sm}\) cannot run FOSCAR's kernels: " \
              r"they are built for sm_90a, sm_100a only .*use_kernels=False"
    with pytest.raises(NotImplementedError, match=message):
        device_arch()
    with pytest.raises(NotImplementedError, match=message):  # what decode and the cache resolve their arch with
        arch_of_device()
    with pytest.raises(NotImplementedError, match=message):  # before allocating anything on the (absent) GPU
        PagedKVCache(Scheme.make(2), 1, 2, 8, 2, 1000, device="cuda:0")


def test_blackwell_runs_its_compile_verified_kernels_with_one_warning(monkeypatch):
    import warnings

    _fake_gpu(monkeypatch, (10, 0), "NVIDIA B200")
    monkeypatch.setattr(jit, "_blackwell_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [jit.device_arch(), arch_of_device().name, jit.device_arch()] == ["sm_100a"] * 3
    assert [str(w.message) for w in caught if w.category is RuntimeWarning] == [
        "NVIDIA B200: FOSCAR's Blackwell (sm_100a) kernels are compile-verified only and have never run on a GPU; "
        "check their outputs against foscar.reference before relying on them: python -m pytest -m gpu (the GPU "
        "suite runs this device's kernels)"]
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    monkeypatch.setattr(jit, "_blackwell_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jit.device_arch() == "sm_90a"  # Hopper runs them: no warning

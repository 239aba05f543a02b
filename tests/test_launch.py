"""The host path both arches share (foscar.launch): each arch's kernel set names its kernels' arguments in
their order, and a cache decode's launch values are refused before anything compiles."""

import inspect

import pytest
import torch

import foscar.launch
from foscar import Scheme
from foscar.archs import ARCHS, BLACKWELL, HOPPER
from foscar.launch import CACHE_ARGS, decode_args
from foscar.split_merge import counter_words
from foscar.work_list import MAX_SPLITS

# the decode entry's output parameters, which the host fills with the final output or the split partials
DECODE_OUTPUTS = {"o": "o_part", "lse": "lse_part"}


def _parameters(kernel, host_names=None) -> tuple[str, ...]:
    names = list(inspect.signature(kernel.__call__).parameters)
    assert names[0] == "self" and names[-1] == "stream", names
    return tuple((host_names or {}).get(n, n) for n in names[1:-1])


@pytest.mark.parametrize("arch", ARCHS.values(), ids=lambda a: a.name)
def test_argument_lists_follow_the_kernels_signatures(arch):
    """The names the host passes by are the kernels' parameters in order: a swap of two arguments of one
    type would compile to the same code and read the wrong tensor."""
    kernels = arch._kernels()
    assert kernels.arch == arch.name
    assert _parameters(kernels.decode_kernel, DECODE_OUTPUTS) == decode_args(True)
    assert _parameters(kernels.cache_kernel) == CACHE_ARGS
    assert set(CACHE_ARGS) <= set(foscar.launch.POINTERS) | set(foscar.launch.SCALARS)


@pytest.mark.parametrize("arch, scheme, page_size, one_launch", [
    (HOPPER, Scheme.make(2, gqa_ratio=4), 128, True),
    (HOPPER, Scheme.make(2, "channel", 256, "token", 128, 256, 8), 256, False),  # the window kernel's launch too
    (BLACKWELL, Scheme.make(2, gqa_ratio=4), 128, True),
], ids=["hopper-one-launch", "hopper-two-launches", "blackwell-one-launch"])
def test_cache_launch_values_are_checked_before_compiling(monkeypatch, arch, scheme, page_size, one_launch):
    """Bad splits, counters, CTA budget, an empty batch or (where the window kernel runs) too many window
    slots raise a ValueError naming them before the decode kernel compiles."""
    def compile_(*args, **kwargs):
        raise AssertionError("compiled before the checks")

    monkeypatch.setattr(foscar.launch, "cached_compile", compile_)
    kernels = arch._kernels()
    assert kernels.fuses_window(scheme, page_size, *kernels.options(scheme, 1)) == one_launch
    d, kv_heads = scheme.head_dim, 2
    q = torch.zeros(2, kv_heads * scheme.gqa_ratio, d, dtype=torch.bfloat16)
    k_codes = torch.zeros(1, kv_heads, page_size // 64, 8, dtype=torch.int32)  # [pages, kv_heads, tiles, words]
    window = torch.zeros(4, kv_heads, 448, d, dtype=torch.bfloat16)
    counters = torch.zeros(counter_words(4, MAX_SPLITS), dtype=torch.int32)
    cases = [(dict(num_splits=0), "num_splits must be in"), (dict(num_splits=MAX_SPLITS + 1), "num_splits must be in"),
             (dict(counters=counters[:-1]),
              rf"counters: need int32 with >= {counters.numel()} elements .*batch \* kv_heads = 4"),
             (dict(counters=counters.float()), "counters: need int32"),
             (dict(budget=0), "budget must be an int in"), (dict(budget=2.0), "budget must be an int in"),
             (dict(q=q[:0]), "batch must hold at least one sequence")]
    if not one_launch:
        cases.append((dict(k_win=torch.zeros(4, kv_heads, 4224, d)), r"the sink \+ window kernel takes at most 4096"))
    for change, message in cases:
        args = dict(q=q, k_win=window, counters=counters, num_splits=4, budget=132) | change
        with pytest.raises(ValueError, match=message):
            kernels.run_cache_decode(args["q"], k_codes, None, None, None, torch.zeros(4, 1, dtype=torch.int32),
                                     args["k_win"], args["k_win"], None, None, args["counters"], 64, 256, 1.0, scheme,
                                     args["num_splits"], args["budget"])


@pytest.mark.parametrize("arch", ARCHS.values(), ids=lambda a: a.name)
def test_the_kernel_classes_state_their_limits(arch):
    """can_implement lives on the kernel classes (foscar.decode_kernel.DecodeKernelBase, as the CUTLASS examples'
    kernel classes): a page size or gqa ratio beyond the class's limits is refused by the class itself,
    naming the field, without a config or a compile; the kernel set asks the same class."""
    kernels = arch._kernels()
    kernel = kernels.decode_kernel
    assert kernel.arch == arch.name and issubclass(kernels.cache_kernel, kernel)
    with pytest.raises(ValueError, match="page_size must be one of"):
        kernel.can_implement(Scheme.make(2), 96)
    with pytest.raises(ValueError, match="gqa_ratio=17"):
        kernel.can_implement(Scheme.make(2, gqa_ratio=17), 128)
    kernel.can_implement(Scheme.make(2, gqa_ratio=4), 128)
    with pytest.raises(ValueError, match="page_size must be one of"):
        kernels.can_implement(Scheme.make(2), 96)


def test_both_arches_share_the_entries_and_the_tile_copies():
    """One host entry per launch kind and one producer copy of a packed tile for both arches' kernels."""
    hopper, blackwell = HOPPER._kernels(), BLACKWELL._kernels()
    assert hopper.decode_kernel.__call__ is blackwell.decode_kernel.__call__
    assert hopper.cache_kernel.__call__ is blackwell.cache_kernel.__call__
    assert hopper.decode_kernel.copy_tile is blackwell.decode_kernel.copy_tile


def test_short_splits_take_two_consumer_warpgroups(monkeypatch):
    """Hopper's split decode launches compile with 2 consumer warpgroups where the default is 3 and each CTA attends
    at most SHORT_SPLIT_TOKENS (the page table's capacity over the splits); an unsplit one-token launch over rows of at
    most SHORT_CONTEXT_TOKENS, more than one wave of CTAs at one per SM, one warpgroup at two CTAs per SM where its loop
    still pipelines; else the default; a caller's own count wins, a None count is no count; the arch registry
    (decode_paged's compile-ahead of several launches) gives the same options."""
    from foscar.hopper.decode import KERNELS, SHORT_CONTEXT_TOKENS, SHORT_SPLIT_TOKENS
    from foscar.hopper.kernel import default_consumers

    scheme = Scheme.make(2, "token", 128, "token", 128, 128, 4)
    two, three = ({"consumers": c, "ctas_per_sm": 1} for c in (2, 3))
    two_ctas = {"consumers": 1, "ctas_per_sm": 2}
    assert default_consumers(scheme) == 3
    assert KERNELS.launch_options(scheme, 1, 16 * SHORT_SPLIT_TOKENS, 16) == two
    assert KERNELS.launch_options(scheme, 1, 16 * SHORT_SPLIT_TOKENS + 64, 16) == three
    waves = 2048 / 132  # 256 x 2K, 8 KV heads, on 132 SMs
    assert KERNELS.launch_options(scheme, 1, SHORT_SPLIT_TOKENS, 1, waves) == two_ctas  # unsplit
    assert KERNELS.launch_options(scheme, 1, SHORT_CONTEXT_TOKENS, 1, 1.01) == two_ctas
    assert KERNELS.launch_options(scheme, 1, SHORT_CONTEXT_TOKENS, 1, 1.0) == three  # one wave: 4 warps per SM
    assert KERNELS.launch_options(scheme, 1, SHORT_CONTEXT_TOKENS, 1) == three  # the grid not known
    assert KERNELS.launch_options(scheme, 1, SHORT_CONTEXT_TOKENS + 64, 1, waves) == three
    # several query tokens: not measured at two CTAs per SM
    assert KERNELS.launch_options(scheme, 4, SHORT_SPLIT_TOKENS, 1, waves) == {
        "consumers": default_consumers(scheme, 4), "ctas_per_sm": 1}
    int4 = Scheme.make(4, "channel", 128, "token", 128, 128, 4)  # 2 by default: kept
    assert KERNELS.launch_options(int4, 1, 1024, 16) == {"consumers": default_consumers(int4), "ctas_per_sm": 1} == two
    int8 = Scheme.make(8, "token", 128, "token", 128, 128, 4)  # one stage per warp in half an SM: not pipelined
    assert KERNELS.launch_options(int8, 1, 1024, 1, waves) == {"consumers": default_consumers(int8), "ctas_per_sm": 1}
    gqa16 = Scheme.make(2, "token", 128, "token", 128, 128, 16)  # two n8 blocks of columns: not pipelined
    assert KERNELS.launch_options(gqa16, 1, 1024, 1, waves) == {"consumers": default_consumers(gqa16),
                                                                 "ctas_per_sm": 1}
    assert HOPPER.launch_options(scheme, 1, 1024, 16) == KERNELS.launch_options(scheme, 1, 1024, 16)
    assert HOPPER.launch_options(scheme, 1, 1024, 1, waves) == KERNELS.launch_options(scheme, 1, 1024, 1, waves)
    assert BLACKWELL.launch_options(scheme, 1, 1024, 16) == {}

    for bad in ({"consumers": True}, {"ctas_per_sm": "2"}, {"consumers": 1.0}):
        with pytest.raises(ValueError, match=rf"{next(iter(bad))} must be None or an int, got"):
            KERNELS.options(scheme, 1, **bad)

    asked = []

    class Stop(Exception):
        pass

    def compile_(scheme, page_size, partial, tokens, **options):
        asked.append(options)
        raise Stop

    monkeypatch.setattr(KERNELS, "compile_decode", compile_)
    monkeypatch.setattr(foscar.launch, "sm_waves", lambda device, ctas: ctas / 132)  # (q on the CPU here)
    codes = torch.zeros(1, 2, 2, 8, dtype=torch.int32)  # [pages, kv_heads, tiles per page (128 tokens), words]
    # 2K, 16K per split; 2K unsplit: batch 1 (2 CTAs), batch 67 (134 CTAs: more than a wave)
    for batch, max_pages, splits, options in ((1, 256, 16, two), (1, 256, 2, three), (1, 16, 1, three),
                                              (67, 16, 1, two_ctas)):
        q = torch.zeros(batch, 8, 128, dtype=torch.bfloat16)
        with pytest.raises(Stop):
            KERNELS.run_decode(q, codes, None, codes, None, torch.zeros(batch, max_pages, dtype=torch.int32), None,
                               0.1, scheme, splits)
        assert asked[-1] == options
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(Stop):
        KERNELS.run_decode(q, codes, None, codes, None, torch.zeros(1, 256, dtype=torch.int32), None, 0.1, scheme, 16,
                           consumers=3)
    assert asked[-1] == {"consumers": 3}
    with pytest.raises(Stop):  # benchmarks.hopper_sweep's "auto"
        KERNELS.run_decode(q, codes, None, codes, None, torch.zeros(1, 256, dtype=torch.int32), None, 0.1, scheme, 16,
                           consumers=None)
    assert asked[-1] == two


def test_many_short_sequences_in_the_cache_decode_take_two_ctas_per_sm(monkeypatch):
    """Hopper's cache decode compiles one consumer warpgroup at two CTAs per SM, and its work list fills twice the
    budget, for one query token over more (sequence, KV head) pairs than the one-wave budget whose sequences hold at
    most SHORT_CONTEXT_TOKENS packed tokens (a page-table row, or the page pool over the batch), where its loop
    pipelines with the window tiles in the ring (K token-wise); else the default options, and past one wave, where
    the caller knows the mean packed tokens, the budget of whole waves (foscar.work_list.wave_budget); the budget
    stays within MAX_BUDGET; a caller's options win; the partials' shape follows the budget; Blackwell keeps one CTA
    per SM."""
    from foscar.hopper.decode import KERNELS, SHORT_CONTEXT_TOKENS
    from foscar.hopper.kernel import default_consumers
    from foscar.launch import cache_capacity
    from foscar.work_list import grid_ctas, wave_budget

    scheme, kc = (Scheme.make(2, k, 128, "token", 128, 128, 4) for k in ("token", "channel"))
    two_ctas, default = (1, 2), (default_consumers(scheme), 1)
    short = SHORT_CONTEXT_TOKENS
    assert KERNELS.cache_launch(scheme, 128, 1, short, 133, 132, {}) == (two_ctas, 264)
    assert KERNELS.cache_launch(scheme, 128, 1, short, 132, 132, {}) == (default, 132)  # one wave
    assert KERNELS.cache_launch(scheme, 128, 1, short + 128, 133, 132, {}) == (default, 132)
    assert KERNELS.cache_launch(scheme, 128, 1, 0, 133, 132, {}) == (default, 132)  # capacity not known
    assert KERNELS.cache_launch(scheme, 128, 2, short, 133, 132, {}) == (default, 132)  # several query tokens
    assert KERNELS.cache_launch(kc, 128, 1, short, 133, 132, {}) == ((default_consumers(kc), 1), 132)
    assert KERNELS.cache_launch(scheme, 128, 1, short, 133, 132, {"consumers": 2}) == ((2, 1), 132)
    # past one wave at one CTA per SM with the mean packed tokens known: whole waves (wave_budget); not at two CTAs
    assert KERNELS.cache_launch(scheme, 128, 1, 0, 133, 132, {}, short) == (
        default, wave_budget(132, 133, short)) != (default, 132)
    assert KERNELS.cache_launch(scheme, 128, 1, short, 133, 132, {}, short) == (two_ctas, 264)
    assert KERNELS.cache_launch(scheme, 128, 1, short, 1 << 15, 1 << 16, {"ctas_per_sm": 2})[1] == 1 << 16
    assert KERNELS.cache_partials(scheme, 128, 67, 2, 1, 132, 320, capacity=short) == (grid_ctas(264, 67, 2), 4, 128)
    assert KERNELS.cache_partials(scheme, 128, 66, 2, 1, 132, 320) == (grid_ctas(132, 66, 2), 4, 128)
    assert BLACKWELL._kernels().cache_launch(scheme, 128, 1, short, 133, 132, {}, short) == (
        (), wave_budget(132, 133, short))
    assert BLACKWELL._kernels().cache_launch(scheme, 128, 1, short, 133, 132, {}) == ((), 132)

    codes = torch.zeros(1000, 2, 1, 8, dtype=torch.int32)  # [pages (the pool), kv_heads, tiles per page, words]
    assert cache_capacity(codes, torch.zeros(4, 256, dtype=torch.int32), 4) == 250 * 64  # the pool over the batch
    assert cache_capacity(codes, torch.zeros(4, 16, dtype=torch.int32), 4) == 16 * 64  # a page-table row

    asked = []

    class Stop(Exception):
        pass

    def compile_(scheme, page_size, tokens, opts):
        asked.append(opts)
        raise Stop

    monkeypatch.setattr(KERNELS, "_cache_decode", compile_)
    counters = torch.zeros(4096, dtype=torch.int32)
    win = torch.zeros(1, 2, 320, 128, dtype=torch.bfloat16)
    for batch, pool, options in ((67, 67 * 4, two_ctas), (67, 67 * 1000, default), (66, 66 * 4, default)):
        codes = torch.zeros(pool, 2, 2, 8, dtype=torch.int32)
        q = torch.zeros(batch, 8, 128, dtype=torch.bfloat16)
        with pytest.raises(Stop):
            KERNELS.run_cache_decode(q, codes, None, codes, None, torch.zeros(batch, 1000, dtype=torch.int32), win,
                                     win, None, None, counters, 64, 256, 0.1, scheme, 1, 132)
        assert asked[-1] == options


class _Captured(Exception):
    pass


class _Entry:
    """Stands in for an arch kernel: the shared entries hand it their bundles."""

    def launch_decode(self, args, grid, stream):
        raise _Captured(args, grid)

    def launch_cache(self, args, stream):
        raise _Captured(args, None)


def _bundled(entry, names):
    """Run a compiled entry's Python body with each flat argument a distinct number; the bundle it builds, as a
    dict from field path to the flat argument's name (sm_scale goes in times log2(e))."""
    import dataclasses

    values = {name: 10 + i for i, name in enumerate(names)}
    with pytest.raises(_Captured) as caught:
        entry.__wrapped__(_Entry(), *values.values(), None)
    args, grid = caught.value.args
    by_value = {v: k for k, v in values.items()}

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            x = getattr(obj, f.name)
            if dataclasses.is_dataclass(x):
                yield from walk(x, prefix + f.name + ".")
            else:
                yield prefix + f.name, x

    return dict(walk(args, "")), by_value, grid, values


def test_the_entries_bundle_every_argument_under_its_own_name():
    """The flat arguments land in the bundle field of the same name (a swap of two pointers inside a bundle would
    compile to the same code and read the wrong tensor): every pointer and scalar by name, the decode's outputs as
    ``o`` / ``lse``, the score scale times log2(e), the grid (split, KV head, sequence), ``heads`` = batch x
    kv_heads."""
    from foscar.decode_kernel import CacheDecodeBase, DecodeKernelBase
    from foscar.device import LOG2E

    fields, by_value, grid, values = _bundled(DecodeKernelBase.__call__, decode_args(False))
    renamed = {"out": "o", "lse": "lse"}
    for field, x in fields.items():
        if field == "scale_log2":
            assert x == pytest.approx(values["sm_scale"] * LOG2E)
        else:
            assert renamed.get(by_value[x], by_value[x]) == field.split(".")[-1], field
    assert set(by_value[x] for f, x in fields.items() if f != "scale_log2") == set(decode_args(False)) - {
        "batch", "sm_scale"}
    assert grid == (values["num_splits"], values["kv_heads"], values["batch"])

    fields, by_value, _, values = _bundled(CacheDecodeBase.__call__, CACHE_ARGS)
    assert fields.pop("output.heads") == values["batch"] * values["kv_heads"]
    assert fields.pop("scale_log2") == pytest.approx(values["sm_scale"] * LOG2E)
    assert {f.split(".")[-1]: by_value[x] for f, x in fields.items()} == {n: n for n in CACHE_ARGS if n != "sm_scale"}

"""The arch registry: per GPU arch, what FOSCAR builds for it and what it cannot build.

One :class:`Arch` per target ("sm_90a": Hopper, "sm_100a": Blackwell) names its packed-tile bit
order (``foscar.layouts.PACKERS``), its operand construction per bit width, and its decode kernels
(the ``KERNELS`` of the arch's module, imported only when used: a ``foscar.launch.KernelSet``, which
compiles and launches them on the host path both arches share). As in the CUTLASS
examples, :meth:`Arch.can_implement` states the kernel's limits *before* anything compiles (the kernel
set's ``can_implement``): a variant the kernel cannot build raises a ValueError naming the field to
change. ``foscar.decode`` and ``foscar.cache`` dispatch through :data:`ARCHS`; nothing else branches on
an arch name.

``Scheme`` itself accepts more than any kernel builds (e.g. ``gqa_ratio`` up to 64, which the
float64 references handle); the kernels' limits live with their kernel sets
(``foscar/hopper/decode.py``, ``foscar/blackwell/decode.py``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .targets import TARGETS
from .formats import Unsupported, append_mismatch
from .scheme import Construction, Scheme, construction_for

__all__ = ["Arch", "ARCHS", "HOPPER", "BLACKWELL", "get_arch", "arch_of_device", "packed_layouts"]


@dataclass(frozen=True)
class Arch:
    """One compile target: its packed layout, constructions, decode kernel and limits."""

    name: str  # the compile target, "sm_90a"
    layout: str  # bit order inside a packed 64-token tile (foscar.layouts.PACKERS)
    kernel_module: str  # module whose KERNELS (a foscar.launch.KernelSet) are this arch's decode kernels
    cache_decode: bool  # has PagedKVCache's decode (packed pages + 16-bit sink + window, splits merged in-launch)
    prefill_module: str | None = None  # module of its prefill kernel (many query rows over packed pages), if any

    def construction(self, fmt) -> Construction:
        """How this arch's kernel turns codes of ``fmt`` (a Format, a registered name or a bit width)
        into Tensor Core operands."""
        return construction_for(self.name, fmt)

    def _kernels(self):
        return importlib.import_module(self.kernel_module).KERNELS

    def can_implement(self, scheme: Scheme, page_size: int) -> None:
        """Return if the decode kernel builds ``scheme`` at ``page_size``; else raise a ValueError
        naming the field (TypeError for a non-Scheme). Compiles nothing: the arch's kernel set states
        its limits (``KernelSet.can_implement``, ``foscar.launch``)."""
        if not isinstance(scheme, Scheme):
            raise TypeError(f"scheme must be a foscar.Scheme, got {type(scheme).__name__}")
        self._kernels().can_implement(scheme, page_size)

    def _fuses_window(self, scheme: Scheme, page_size: int) -> bool:
        """Whether the cache decode attends the 16-bit sink + window slots in its own launch (no limit
        of its own on their count) rather than with ``foscar.kernels.sink_window``."""
        kernels = self._kernels()
        return kernels.fuses_window(scheme, page_size, *kernels.options(scheme, 1))

    def check_cache(self, scheme: Scheme, page_size: int, slots: int, what: str = "sink + window + granule"):
        """Raise a ValueError naming the field if :class:`~foscar.cache.PagedKVCache`'s GPU decode
        cannot take ``scheme`` at ``page_size`` with ``slots`` 16-bit slots per (sequence, KV head)
        (``what`` names them), or whose append kernel cannot quantize its formats (``append_mismatch``: refused
        before any append writes anything); compiles nothing."""
        self.can_implement(scheme, page_size)
        for name, quant in (("k", scheme.k), ("v", scheme.v)):
            mismatch = append_mismatch(quant.format)
            if mismatch:
                raise Unsupported(f"Scheme.{name}.format: {mismatch}")
        if not self._fuses_window(scheme, page_size):
            from .kernels.sink_window import check_sink_window

            check_sink_window(scheme.head_dim, scheme.gqa_ratio, slots, what)

    def compile_decode(self, scheme: Scheme, page_size: int, partial_output: bool = False, tokens: int = 1,
                       **options):
        """The compiled decode kernel for ``tokens`` query tokens per sequence (the packed pages' last, causal;
        cached per process; works without a GPU). ``options`` go to the arch's ``KernelSet.options`` (Hopper:
        ``consumers``, ``ctas_per_sm``)."""
        self.can_implement(scheme, page_size)
        return self._kernels().compile_decode(scheme, page_size, partial_output, tokens, **options)

    def launch_options(self, scheme: Scheme, tokens: int, capacity: int, num_splits: int, waves: float = 0.0) -> dict:
        """The compile options :meth:`run_decode` takes for ``num_splits`` splits of page-table rows of ``capacity``
        tokens in ``waves`` waves of CTAs (``foscar.launch.sm_waves``) (Hopper: ``consumers``, ``ctas_per_sm``), so
        that a caller compiling ahead gets the same kernel."""
        return self._kernels().launch_options(scheme, tokens, capacity, num_splits, waves)

    def launch_options_for(self, scheme: Scheme, q, k_codes, page_table, num_splits: int, tokens: int) -> dict:
        """:meth:`launch_options` of a launch on these tensors (``KernelSet.launch_options_for``)."""
        return self._kernels().launch_options_for(scheme, q, k_codes, page_table, num_splits, tokens)

    def compile_cache_decode(self, scheme: Scheme, page_size: int, tokens: int = 1):
        """The compiled decode launch of :class:`~foscar.cache.PagedKVCache` (Hopper: packed pages,
        window slots and merge in one, or the quantized splits' partials where
        ``foscar.hopper.cache_decode.fuses_window`` says no; Blackwell: packed pages, window blocks and merge in
        one, ``foscar.blackwell.cache_decode``; cached per process; works without a GPU) for ``tokens`` query tokens per sequence."""
        if not self.cache_decode:
            raise NotImplementedError(f"the {self.name} kernels have no PagedKVCache decode")
        self.check_query_tokens(scheme, page_size, tokens)
        return self._kernels().compile_cache_decode(scheme, page_size, tokens)

    def max_query_tokens(self, scheme: Scheme) -> tuple[int, str]:
        """The most query tokens per sequence one decode launch (of the cache decode or the decode) takes
        (speculative verification: ``PagedKVCache.attend`` or ``decode_paged`` of a 4-D q; both cut more into
        launches), and why no more; compiles nothing."""
        return self._kernels().max_query_tokens(scheme)

    def check_query_tokens(self, scheme: Scheme, page_size: int, tokens: int) -> None:
        """Raise a ValueError naming ``q`` if the cache decode cannot take ``tokens`` query tokens per
        sequence (:meth:`max_query_tokens`); compiles nothing."""
        self.can_implement(scheme, page_size)
        self._kernels().check_launch_tokens(scheme, tokens, f"cache decode of {scheme.name}",
                                            "PagedKVCache.attend_chunk takes more")

    def run_decode(self, q, k_codes, k_params, v_codes, v_params, page_table, lengths, sm_scale, scheme: Scheme,
                   num_splits: int = 1, out=None, lse=None):
        """Launch on validated CUDA tensors (``foscar.decode.decode_paged`` validates); returns ``(out, lse)``."""
        return self._kernels().run_decode(q, k_codes, k_params, v_codes, v_params, page_table, lengths, sm_scale,
                                          scheme, num_splits, out, lse)

    def run_cache_decode(self, q, k_codes, k_params, v_codes, v_params, page_table, k_win, v_win, seq_rows,
                         seq_lengths, counters, sink: int, window: int, sm_scale: float, scheme: Scheme,
                         num_splits: int, budget: int, packed_mean: int = 0):
        """Decode over a :class:`~foscar.cache.PagedKVCache` layer (the cache validates): the quantized
        splits and the 16-bit sink + window, merged in one launch (``foscar.hopper.cache_decode``,
        ``foscar.blackwell.cache_decode``), its work split on the device by the sequences' lengths over a wave of
        ``budget`` CTAs, or past one wave over whole waves where the sequences' mean packed tokens ``packed_mean``
        are known (``foscar.work_list``, ``KernelSet.cache_launch``); on Hopper ``num_splits`` splits per sequence
        and the window kernel where the window does not fit its ring; returns ``(out, lse)``."""
        if not self.cache_decode:
            raise NotImplementedError(f"the {self.name} kernels have no PagedKVCache decode")
        return self._kernels().run_cache_decode(q, k_codes, k_params, v_codes, v_params, page_table, k_win, v_win,
                                                seq_rows, seq_lengths, counters, sink, window, sm_scale, scheme,
                                                num_splits, budget, packed_mean)


    def takes_prefill(self, scheme: Scheme) -> bool:
        """Whether the cache may route a chunk's packed pages to this arch's prefill kernel: it builds ``scheme``
        (Hopper's ``foscar.hopper.prefill``: head_dim 128, formats the dequantize kernel reads) and has run its
        configuration (both roles' formats and q's dtype together) on a GPU (``PrefillConfig.has_run``); compiles
        nothing."""
        if self.prefill_module is None:
            return False
        try:
            cfg = importlib.import_module(self.prefill_module).prefill_config(scheme, scheme.q_dtype_name,
                                                                              self.layout)
        except ValueError:
            return False
        return cfg.has_run

    def run_prefill(self, q_rows, k_codes, k_params, v_codes, v_params, page_row, tokens: int, sm_scale: float,
                    scheme: Scheme):
        """Many query rows over the first ``tokens`` packed tokens of one sequence's pages (the module's
        ``run_prefill``: the cache checks the tensors); returns the splits' ``(out, lse)``."""
        if self.prefill_module is None:
            raise NotImplementedError(f"the {self.name} kernels have no prefill kernel")
        return importlib.import_module(self.prefill_module).run_prefill(
            q_rows, k_codes, k_params, v_codes, v_params, page_row, tokens, sm_scale, scheme, self.layout)


HOPPER = Arch("sm_90a", "hopper", "foscar.hopper.decode", cache_decode=True, prefill_module="foscar.hopper.prefill")
BLACKWELL = Arch("sm_100a", "blackwell", "foscar.blackwell.decode", cache_decode=True)
ARCHS: dict[str, Arch] = {arch.name: arch for arch in (HOPPER, BLACKWELL)}
if tuple(ARCHS) != TARGETS:  # the compile layer names the same targets (foscar.targets)
    raise ImportError(f"foscar.archs registers {tuple(ARCHS)}, foscar.targets names {TARGETS}")


def get_arch(name: str) -> Arch:
    """The registered arch called ``name``, or a ValueError naming ``arch``."""
    if name not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {name!r}")
    return ARCHS[name]


def arch_of_device(device=None) -> Arch:
    """The arch of a CUDA device (``FOSCAR_ARCH`` overrides it; ``foscar.jit.device_arch``)."""
    from .jit import device_arch

    return get_arch(device_arch(device))


def packed_layouts() -> list[str]:
    """Every registered arch's packed layout."""
    return sorted({arch.layout for arch in ARCHS.values()})

"""Blackwell (sm_100a) variant: tcgen05 MMAs with FP4/FP8 operands built from packed codes, TMEM accumulators.

Compile-verified only (no Blackwell GPU in this project's machines). ``decode.KERNELS.compile_decode``
works on any machine. ``kernel`` is built from the scheme's sm_100a plan: ``folds`` holds the fold cases' device
hooks (one class per case, registered against ``foscar.folds``), ``operands`` the FP4/FP8 recipes
per tensor and their CPU emulation, ``storage`` the named shared-memory offsets, ``pipeline`` the
mbarrier handoffs.
"""

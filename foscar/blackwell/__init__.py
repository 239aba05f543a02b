"""Blackwell (sm_100a) variant: tcgen05 MMAs with FP4/FP8 operands built from packed codes, TMEM accumulators.

Compile-verified only (no Blackwell GPU in this project's machines). ``compile_decode`` works on any
machine; ``operands`` holds the FP4/FP8 construction recipes and their CPU emulation.
"""

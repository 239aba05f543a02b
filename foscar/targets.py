"""The compile targets FOSCAR builds kernels for, by name only (the bottom of the layering, so that the
formats, the compile layer and the arch registry share one list; ``foscar.archs`` gives each its kernels)."""

HOPPER = "sm_90a"  # H100, H200: runs the kernels
BLACKWELL = "sm_100a"  # B200: compile-verified only
TARGETS = (HOPPER, BLACKWELL)

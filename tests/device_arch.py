"""The arch the GPU tests run: the device's (``foscar.archs.arch_of_device``), so that on an sm_100 GPU the GPU suite
checks the Blackwell kernels. A test of one arch's launch choices, or of bounds measured on one arch, skips on the
other with its reason; a scheme whose formats the device's arch builds no operands for skips with the arch's reason."""

import pytest

from foscar.archs import Arch, arch_of_device
from foscar.formats import Unsupported


def device_arch() -> Arch:
    """The arch whose kernels this GPU runs."""
    return arch_of_device()


def require_arch(name: str, why: str) -> None:
    """Skip the calling test unless the device's arch is ``name`` (``why``: what is specific to it)."""
    arch = device_arch()
    if arch.name != name:
        pytest.skip(f"{why}: {name} only; this device runs {arch.name}")


def skip_unless_builds(scheme, page_size: int) -> None:
    """Skip the calling test where the device's arch builds no operands for ``scheme``'s formats (``Unsupported``,
    e.g. the INT8 user format on sm_100a); any other refusal is the test's failure."""
    arch = device_arch()
    try:
        arch.can_implement(scheme, page_size)
    except Unsupported as err:
        pytest.skip(f"{arch.name} does not build {scheme.name}: {err}")

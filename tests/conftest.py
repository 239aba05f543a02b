import os

import pytest
import torch

import user_formats  # noqa: F401  (registers the formats written outside the package: tests/user_formats.py)


def _nvdisasm_missing() -> str | None:
    """Why SASS cannot be read here (find_nvdisasm's message), or None where nvdisasm is found."""
    from foscar.inspect import find_nvdisasm

    try:
        find_nvdisasm()
    except RuntimeError as exc:
        return str(exc)
    return None


def pytest_collection_modifyitems(config, items):
    # markers are registered in pyproject.toml ([tool.pytest.ini_options])
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine (python -m pytest -m gpu)")
    missing = _nvdisasm_missing() if any("sass" in item.keywords for item in items) else None
    skip_sass = pytest.mark.skip(reason=f"reads SASS: {missing}")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "sass" in item.keywords and missing:  # the one nvdisasm guard of the suite
            item.add_marker(skip_sass)


@pytest.fixture
def rng():
    """A freshly seeded generator per test; the seed is printed so that a failure can be replayed
    (``FOSCAR_TEST_SEED=<seed> pytest <the test's id>``)."""
    seed = int(os.environ.get("FOSCAR_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)

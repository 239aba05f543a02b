import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # markers are registered in pyproject.toml ([tool.pytest.ini_options])
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine (python -m pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    """A freshly seeded generator per test; the seed is printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)

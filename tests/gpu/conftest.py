"""tests/gpu: the tests that need a CUDA device and Triton.

Every test collected here is marked `gpu` (scripts/gpu_check.sh selects them with `-m gpu`; the CPU
suite's `-m 'not gpu'` leaves them out), and on a machine without CUDA or Triton their files are not
imported at all, so they may import CUDA-only modules at the top.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def _has_cuda_and_triton() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


collect_ignore_glob = [] if _has_cuda_and_triton() else ["test_*.py"]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)

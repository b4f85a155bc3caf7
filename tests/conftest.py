import os

# Kernels compile for Hopper on any machine: set before cutlass is first imported.
os.environ.setdefault("CUTE_DSL_ARCH", os.environ.get("CUDNN_TRAIN_ARCH", "sm_90a"))

import zlib

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu tier: no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    if torch.cuda.is_available():
        return f"gpu tier: on ({torch.cuda.get_device_name()})"
    return "gpu tier: skipped (no CUDA GPU on this machine)"


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # every test draws its own random inputs; the seed varies per test but is reproducible
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    """A fresh kernel cache for a compile test: the disk cache in ``tmp_path`` (returned: the test counts the
    objects it compiled there) and none in memory, so that every kernel it asks for is compiled."""
    from cudnn_train.kernels import compile as kc

    monkeypatch.setenv("CUDNN_TRAIN_CACHE_DIR", str(tmp_path))
    kc.clear_memory_cache()
    return tmp_path

import sys

import pytest
import torch

if not torch.cuda.is_available():
    # flash-linear-attention is a test requirement for one CPU test (its kernels under Triton's interpreter, in a
    # subprocess). Imported in this process it would register its own models with transformers' Auto classes
    # (mamba2, ...) and transformers would bind Qwen3-Next to its Triton kernels, none of which runs without a
    # GPU: the Hugging Face tests' reference models must be transformers' own. Blocked, `import fla` fails as if
    # it were not installed (forked ranks inherit this); GPU machines keep it.
    sys.modules.setdefault("fla", None)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Code under test (launcher setup, initialize_megatron) writes RANK/WORLD_SIZE/MASTER_* into
    os.environ; give every test the environment it started with."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)

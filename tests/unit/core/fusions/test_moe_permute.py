"""--moe-permute-fusion's kernels (megatron/core/fusions/moe_permute.py): under Triton's CPU interpreter (its own
process), the fused permutation and unpermutation equal the eager sort-based ones, forward and backward, with and
without routing probabilities (moe_permute_interpreted_worker.py). Without the kernels (CPU tensors) the fused
functions are the eager ones."""
import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch

from megatron.core.transformer.moe import moe_utils

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_permute_interpreted_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def _triton_version():
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return ""


@pytest.mark.skipif(not _triton_version().startswith("3."), reason="needs Triton 3 (requirements-test.txt)")
def test_fused_permutation_equals_eager_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, WORKER], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert len(rows) == 2 * 4 * (4 + 6 + 6), proc.stdout
    bad = [" ".join(r) for r in rows if float(r[1]) > float(r[2])]
    assert not bad, "over tolerance (case, error, tolerance):\n" + "\n".join(bad)


def test_without_kernels_the_fused_functions_are_eager():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=gen)
    routing_map = torch.zeros(5, 4, dtype=torch.bool).scatter_(1, torch.rand(5, 4, generator=gen).topk(2).indices,
                                                               True)
    rows, _, sorted_indices = moe_utils._fused_permute(x, routing_map, topk=2, num_out_tokens=10)
    ref_rows, _, ref_sorted = moe_utils._permute(x, routing_map, topk=2, num_out_tokens=10)
    assert torch.equal(rows, ref_rows) and torch.equal(sorted_indices, ref_sorted)
    assert not hasattr(sorted_indices, "token_rows")  # the eager way back is taken
    out = moe_utils._fused_unpermute(rows, sorted_indices, x.shape, topk=2)
    assert torch.allclose(out, 2 * x)

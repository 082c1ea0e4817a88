"""Muon on CUDA: the bf16 Newton-Schulz (Megatron's default `--muon-fp32-matmul-prec medium`) against a
float64 reference, and the issue's bar, Muon's optimizer step <= 1.5x AdamW's on the Llama-3-8B-shaped
benchmark model (tools/benchmark.py's llama3-8b: 6 of 32 layers on one GPU), read from the log's
`optimizer` timer by tools/bench_optimizer_step.py.

    OMP_NUM_THREADS=4 python -m pytest -q tests/gpu/test_muon_gpu.py
    python tools/bench_optimizer_step.py --config llama3-8b                  # the numbers alone
    python tools/bench_optimizer_step.py --config llama3-8b --nproc 8 -- --use-distributed-optimizer  # dist_muon
"""
import os
import subprocess
import sys

import pytest
import torch

from megatron.core.optimizer.muon import newton_schulz
from tests.unit.core.optimizer.test_muon import ns64

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("shape", [(4096, 1024), (1024, 14336)])
def test_bf16_newton_schulz_on_cuda(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    ref = ns64(x)
    out = newton_schulz(x.cuda(), 5, bf16=True).cpu().double()
    # bf16 iterations: ~1e-2 relative per entry; the entries are ~1/sqrt(min dim).
    assert ((out - ref).norm() / ref.norm()).item() < 3e-2
    high = newton_schulz(x.cuda(), 5).cpu().double()  # fp32 (TF32 off by default)
    assert ((high - ref).norm() / ref.norm()).item() < 1e-3


def test_muon_step_at_most_1_5x_adamw():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_optimizer_step.py"), "--config",
                        "llama3-8b", "--max-ratio", "1.5"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    print(p.stdout[-2000:])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]

"""Hybrid models under context parallelism on two GPUs (NCCL, bf16): a Mamba-2 + Gated DeltaNet + attention +
MLP pattern trained through pretrain_hybrid.py at CP=2 follows the CP=1 loss curve within bf16 noise (the CPU
tests prove the fp32 equality). Needs two CUDA devices."""
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.gpu.benchmark_runs import failure_text

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ("--hybrid-layer-pattern M*G- --hidden-size 512 --num-attention-heads 8 --seq-length 2048 "
         "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 --train-iters 10 --lr 3e-4 "
         "--mamba-state-dim 64 --mamba-head-dim 64 --mamba-num-groups 2 --linear-key-head-dim 64 "
         "--linear-value-head-dim 64 --linear-num-key-heads 2 --linear-num-value-heads 4 --normalization RMSNorm "
         "--swiglu --disable-bias-linear --position-embedding-type rope --bf16 --mock-data --tokenizer-type "
         "NullTokenizer --vocab-size 4096 --log-interval 1 --eval-iters 0 --num-workers 0 "
         "--no-create-attention-mask-in-dataloader --attention-dropout 0 --hidden-dropout 0 --seed 1234").split()
LOSS = re.compile(r"iteration +\d+/ +\d+ \|.*?lm loss: (\S+) \|")


def _losses(nproc, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           os.path.join(ROOT, "pretrain_hybrid.py")] + FLAGS + list(extra)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": ROOT, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert p.returncode == 0, failure_text(p)
    return [float(m.group(1)) for m in map(LOSS.search, p.stdout.splitlines()) if m]


def test_cp2_follows_cp1():
    cp1 = _losses(1)
    cp2 = _losses(2, "--context-parallel-size", "2")
    print("cp1", cp1, "\ncp2", cp2)
    assert len(cp1) == len(cp2) == 10 and cp1[-1] < cp1[0]
    assert cp2 == pytest.approx(cp1, abs=3e-2)

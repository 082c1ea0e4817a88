"""--profile --use-pytorch-profiler on two GPUs over NCCL: each rank writes a Chrome trace of the window with
the step's forward, backward and optimizer ranges and the CUDA kernels they launched, and the losses equal an
unprofiled run's within bf16 noise (cuDNN attention backward is not bitwise deterministic). Needs two CUDA
devices; skipped otherwise."""
import glob
import json
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
FLAGS = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 6 --lr 1e-3 --mock-data --bf16 "
         "--tokenizer-type NullTokenizer --vocab-size 1024 --log-interval 1 --eval-iters 0").split()


def _run(extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           os.path.join(ROOT, "pretrain_gpt.py"), *FLAGS, *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, failure_text(p)
    return [float(x) for x in re.findall(r"lm loss: ([\d.E+-]+)", p.stdout)]


def test_traces_on_both_ranks_with_cuda_kernels(tmp_path):
    plain = _run([])
    profiled = _run(["--profile", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "4",
                     "--profile-ranks", "0", "1", "--tensorboard-dir", str(tmp_path)])
    assert profiled == pytest.approx(plain, abs=2e-2)
    traces = sorted(glob.glob(str(tmp_path / "*.pt.trace.json")))
    assert [os.path.basename(t).split(".")[0] for t in traces] == ["rank0", "rank1"]
    for trace in traces:
        events = json.load(open(trace))["traceEvents"]
        names = {e.get("name") for e in events}
        assert {"forward", "backward", "optimizer"} <= names
        # Host-side ranges, iterations 2 and 3 (on CUDA each range also has a "gpu_user_annotation" twin).
        assert sum(1 for e in events if e.get("name") == "optimizer" and e.get("cat") == "user_annotation") == 2
        assert any(e.get("cat") == "kernel" for e in events)  # the GPU side was recorded
        assert any("nccl" in str(e.get("name", "")).lower() for e in events)  # and the collectives

"""tools/trace_report.py on the NCCL traces of a PP=2 run on two GPUs: both stages named, the pipeline's
NCCL send/receive kernels told apart (pp_p2p, under P2PCommunicator's ranges) with exposed time, the phases'
device compute placed through the launches, and compute + exposed communication + idle = the window.
Needs two CUDA devices; skipped otherwise."""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.gpu.benchmark_runs import failure_text
from tools.trace_report import analyse_trace

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
         "--micro-batch-size 2 --global-batch-size 16 --train-iters 5 --lr 1e-3 --mock-data --bf16 "
         "--tokenizer-type NullTokenizer --vocab-size 1024 --log-interval 1 --eval-iters 0 "
         "--pipeline-model-parallel-size 2 --profile --use-pytorch-profiler --profile-step-start 3 "
         "--profile-step-end 5 --profile-ranks 0 1").split()


def test_pipeline_timeline_from_nccl_traces(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           os.path.join(ROOT, "pretrain_gpt.py"), *FLAGS, "--tensorboard-dir", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, failure_text(p)
    paths = sorted(glob.glob(str(tmp_path / "*.pt.trace.json")))
    reports = [analyse_trace(json.load(open(path))) for path in paths]
    assert [(r["rank"], r["layout"]["pp_rank"]) for r in reports] == [(0, 0), (1, 1)]
    for r in reports:
        t = r["timeline"]
        assert t["device"] == "gpu" and t["iterations"] == 2
        assert abs(t["compute_ms"] + t["exposed_comm_ms"] + t["idle_ms"] - r["wall_ms"]) < 1e-3
        for name in ("forward", "backward", "optimizer"):
            assert t["phases"][name]["compute_ms"] > 0
        # 8 micro-batches per iteration: each stage sends or receives at least once per micro-batch.
        pp = t["comm"]["pp_p2p"]
        assert pp["count"] >= 8 and 0 < pp["exposed_ms"] <= pp["ms"] + 1e-6
        assert "p2p" not in t["comm"]  # every send/receive of a PP-only run is the pipeline's
        assert 0 < t["pipeline"]["bubble_ms"] <= t["pipeline"]["schedule_ms"] <= r["wall_ms"]

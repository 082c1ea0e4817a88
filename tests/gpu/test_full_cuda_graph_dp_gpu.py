"""--cuda-graph-impl full_iteration with data parallelism on two GPUs: the DDP all-reduce (and the
distributed optimizer's reduce-scatter) captured in the graph; losses match the eager DP run.
Needs two CUDA devices; skipped otherwise."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.gpu.benchmark_runs import failure_text

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tmp_path, name, *flags):
    results = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           os.path.join(ROOT, "tools", "benchmark.py"), "--config", "gpt-125m", "--iters", "8", "--warmup", "4",
           "--results", str(results), "--", "--global-batch-size", "16", "--lr", "1e-4", *flags]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, failure_text(p)
    return json.loads(results.read_text().splitlines()[-1])["losses"]


def test_dp2_graph_matches_eager(tmp_path):
    eager = _run(tmp_path, "eager")
    graph = _run(tmp_path, "graph", "--cuda-graph-impl", "full_iteration")
    distopt_flags = ("--overlap-grad-reduce", "--use-distributed-optimizer")
    eager_distopt = _run(tmp_path, "eager-distopt", *distopt_flags)
    distopt = _run(tmp_path, "graph-distopt", "--cuda-graph-impl", "full_iteration", *distopt_flags)
    print("eager", eager, "\ngraph", graph, "\neager+overlap+distopt", eager_distopt,
          "\ngraph+overlap+distopt", distopt)
    assert len(set(graph)) > 4  # the replayed steps train on new data
    # bf16, same kernels; cuDNN attention / embedding backward are not bitwise deterministic. Each graph run
    # is compared with the eager run of the same reduction (the distributed optimizer's bf16 reduce-scatter
    # rounds its sums elsewhere than DDP's all-reduce). The learning rate is 1e-4, not the benchmark's 3e-4:
    # at 3e-4 the loss spiked at step 9 and the step after it amplified that noise to 0.12 between the two
    # eager runs and 0.20 between graph and eager (10.674 against 10.474 on two H200s), while every other step
    # agreed within 5e-3.
    assert graph == pytest.approx(eager, abs=2e-2)
    assert distopt == pytest.approx(eager_distopt, abs=2e-2)

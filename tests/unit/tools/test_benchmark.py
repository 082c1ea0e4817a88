"""Benchmark helpers: peak table lookup and the memory / FLOPs estimate on the gpt-1.3b config."""
import importlib.util
import os

import pytest

from megatron.training.arguments import parse_args, validate_args
from megatron.training.theoretical_memory_usage import estimate_memory_and_flops
from tests import ROOT


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark", os.path.join(ROOT, "tools", "benchmark.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_peak_table(bench):
    assert bench.dense_bf16_peak("NVIDIA H100 80GB HBM3") == 989.0
    assert bench.dense_bf16_peak("NVIDIA H100 PCIe") == 756.0
    assert bench.dense_bf16_peak("NVIDIA H200") == 989.0
    assert bench.dense_bf16_peak("cpu") is None


def test_gpt13b_estimate(bench):
    cli, extra = bench.parse_cli(["--config", "gpt-1.3b", "--iters", "1", "--warmup", "0"])
    args = validate_args(parse_args(argv=bench.megatron_argv(cli, extra)))
    est = estimate_memory_and_flops(args)
    s, b, h, L = 2048, 4, 2048, 24
    assert est["activations"] == 34 * s * b * h * L  # Megatron's 34*s*b*h per layer for f = 4h
    assert est["flops_per_iteration"] == pytest.approx(69.4e12, rel=1e-3)
    # 1.3B params (+ learned positions) x 18 bytes
    assert est["weights_and_optimizer"] / 2 ** 30 == pytest.approx(22.05, abs=0.01)


def test_benchmark_runs_virtual_pipeline_stages(tmp_path):
    """tools/benchmark.py builds one data iterator per model chunk, as pretrain() does: PP=2 x VP=2 on two gloo
    processes trains (it once passed one iterator for two chunks and the interleaved schedule refused it)."""
    import json
    import subprocess
    import sys
    results = tmp_path / "vp.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           os.path.join(ROOT, "tools", "benchmark.py"), "--config", "tiny", "--iters", "3", "--warmup", "1",
           "--results", str(results), "--", "--num-layers", "4", "--global-batch-size", "4",
           "--micro-batch-size", "1", "--pipeline-model-parallel-size", "2",
           "--num-layers-per-virtual-pipeline-stage", "1"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    losses = json.loads(results.read_text().splitlines()[-1])["losses"]
    assert len(losses) == 4 and losses[-1] < losses[0]

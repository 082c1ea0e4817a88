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

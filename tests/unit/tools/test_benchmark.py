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


def test_iterators_per_model_chunk(monkeypatch):
    """pretrain() and tools/benchmark.py build the schedule's iterators with one function: one per split
    without virtual pipeline stages, one list entry per model chunk with them (the interleaved schedule refuses
    a single iterator for several chunks; the benchmark once passed one). Its PP=2 x VP=2 run is
    tests/gpu/test_pipeline_overlap_gpu.py."""
    import types

    from megatron.training import data_iterators
    built = []

    def fake_build(provider):
        built.append(provider)
        return (f"train{len(built)}", f"valid{len(built)}", f"test{len(built)}")

    monkeypatch.setattr(data_iterators, "build_train_valid_test_data_iterators", fake_build)
    monkeypatch.setattr(data_iterators, "get_args", lambda: types.SimpleNamespace(
        virtual_pipeline_model_parallel_size=None))
    assert data_iterators.build_iterators_for_model_chunks("p", ["chunk"]) == ("train1", "valid1", "test1")
    monkeypatch.setattr(data_iterators, "get_args", lambda: types.SimpleNamespace(
        virtual_pipeline_model_parallel_size=2))
    assert data_iterators.build_iterators_for_model_chunks("p", ["c0", "c1"]) == (
        ["train2", "train3"], ["valid2", "valid3"], ["test2", "test3"])
    source = open(os.path.join(ROOT, "tools", "benchmark.py")).read()
    assert "build_iterators_for_model_chunks(train_valid_test_datasets_provider, model)" in source

"""tools/bench_moe_host.py runs on CPU at a tiny size for each config: three variants (default and the two fusion
flags), each with a host time; on CPU the fusion flags take their eager fallbacks, so no kernel count or GPU time."""
import pytest

from tools import bench_moe_host


@pytest.mark.parametrize("config", ["QWEN3_30B_A3B", "DEEPSEEK_V3_PROXY"])
def test_tiny_layer_on_cpu(config, tmp_path):
    out = tmp_path / "host.json"
    rows = bench_moe_host.main(["--config", config, "--tiny", "--iters", "2", "--json", str(out)])
    assert [r["variant"] for r in rows] == list(bench_moe_host.VARIANTS)
    assert all(r["host_ms"] > 0 and "gpu_ms" not in r for r in rows)
    assert out.exists()

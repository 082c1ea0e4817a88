"""tools/bench_grouped_gemm.py on CPU (fp32, shapes divided by 16): every GEMM of every asked EP has a row with
its block layout and positive times, the summary covers the six, and a layout that does not split says so."""
import json

import pytest
import torch

from tools.bench_grouped_gemm import SHAPES, ExpertShape, _timer, bench_shape, main


@pytest.fixture(autouse=True)
def grouped_mm_on_cpu():
    try:
        torch._grouped_mm(torch.randn(4, 8), torch.randn(1, 8, 8), offs=torch.tensor([4], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        pytest.skip(f"_grouped_mm not available on CPU in this torch: {e}")


def test_rows_for_every_gemm_and_ep(tmp_path, capsys):
    out = tmp_path / "g.json"
    assert main(["--config", "MOE_FINE", "QWEN3_30B_A3B", "--ep", "1", "2", "--scale", "16", "--iters", "1",
                 "--warmup", "0", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 6 and data["ceiling_tflops"] > 0
    fine_ep2 = [r for r in rows if r["config"] == "MOE_FINE" and r["ep"] == 2]
    # 64 experts over 2 ranks; 4096 x 2 / 16 tokens x top-6 rows in equal blocks.
    assert {r["local_experts"] for r in fine_ep2} == {32} and {r["rows_per_expert"] for r in fine_ep2} == {96}
    assert all(r["grouped_ms"] > 0 and r["plain_ms"] > 0 and r["grouped_tflops"] > 0 for r in rows)
    for r in rows:  # the weight gradients' way into the fp32 buffer, timed for the two wgrad GEMMs only
        wgrad = r["gemm"].endswith("wgrad")
        assert ("accumulate_ms" in r) == wgrad and (not wgrad or r["accumulate_ms"] > 0 and r["overwrite_ms"] > 0)
    printed = capsys.readouterr().out
    assert printed.count("six GEMMs") == 4 and printed.count("into the fp32 buffer") == 4


def test_uneven_split_is_refused():
    shape = ExpertShape(hidden=64, ffn=32, experts=6, topk=1, tokens=10)
    with pytest.raises(ValueError, match="do not split evenly"):
        bench_shape("odd", shape, 1, torch.device("cpu"), torch.float32, _timer(torch.device("cpu"), 1, 0))
    with pytest.raises(ValueError, match="do not split over EP=4"):
        bench_shape("odd", shape, 4, torch.device("cpu"), torch.float32, _timer(torch.device("cpu"), 1, 0))
    assert set(SHAPES) == {"MOE_MIXTRAL", "MOE_FINE", "QWEN3_30B_A3B", "DEEPSEEK_V3_PROXY"}

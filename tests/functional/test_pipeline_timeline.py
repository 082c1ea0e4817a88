"""tools/pipeline_timeline.py on two gloo ranks (PP=2, tiny GPT; torchrun's environment, forked from a CliRunner):
one row per stage whose parts add up to the iteration, p2p kinds that match each stage's role, and a Chrome trace
per rank."""
import json

from tests.functional.cli_runner import CliRunner

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 5 --lr 1e-3 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 128 --eval-iters 0 --pipeline-model-parallel-size 2 "
         "--log-interval 1")


def test_two_stage_timeline(tmp_path):
    with CliRunner() as cli:
        results = cli.run(["tools/pipeline_timeline.py", "--out", tmp_path, "--skip", "2", "--", *FLAGS.split()],
                          nranks=2, timeout=300)
    assert [r.rc for r in results] == [0, 0], results[0].err[-3000:] + results[1].err[-3000:]
    assert "| rank | pp stage | iteration | forward | backward |" in "".join(r.out for r in results)
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [r["pp_rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["iterations"] == 3  # 5 trained, the first 2 skipped
        parts = r["forward_ms"] + r["backward_ms"] + r["optimizer_ms"] + sum(r["p2p_ms"].values()) + r["other_ms"]
        assert abs(parts - r["iteration_ms"]) < 1e-6 * max(1.0, r["iteration_ms"])
        assert r["forward_ms"] > 0 and r["backward_ms"] > 0 and r["optimizer_ms"] > 0 and r["other_ms"] >= -1e-6
    first, last = rows[0]["p2p_ms"], rows[1]["p2p_ms"]
    # The first stage sends activations and receives gradients; the last does the opposite.
    assert any("send" in k for k in first) and any("recv" in k for k in last)
    assert "forward-recv" not in first and "forward-recv" in last
    trace = json.loads((tmp_path / "timeline_rank1.json").read_text())["traceEvents"]
    assert {e["cat"] for e in trace} >= {"forward", "backward", "p2p", "optimizer"}
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in trace)

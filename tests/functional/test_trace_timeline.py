"""tools/trace_report.py on the traces of a real 2-rank PP=2 run (gloo, tiny GPT, --profile
--use-pytorch-profiler): one row per pipeline stage, forward / backward / optimizer on both, the pipeline's
sends and receives told apart from the other collectives, and times that are positive and add up."""
import glob
import json

from tests.functional.cli_runner import CliRunner
from tools.trace_report import analyse_trace, main

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 1e-3 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 128 --log-interval 1 --eval-iters 0 "
         "--pipeline-model-parallel-size 2 --profile --use-pytorch-profiler --profile-step-start 2 "
         "--profile-step-end 4 --profile-ranks 0 1").split()


def test_pipeline_timeline_from_profiler_traces(tmp_path, capsys):
    with CliRunner() as cli:
        runs = cli.run(["pretrain_gpt.py", *FLAGS, "--tensorboard-dir", str(tmp_path)], nranks=2, timeout=300)
    for res in runs:
        assert res.rc == 0, res.err[-3000:]
    paths = sorted(glob.glob(str(tmp_path / "*.pt.trace.json")))
    reports = [analyse_trace(json.load(open(p))) for p in paths]
    assert [(r["rank"], r["layout"]["pp_rank"], r["layout"]["pp_size"]) for r in reports] == [(0, 0, 2), (1, 1, 2)]
    eps = 1e-6
    for r in reports:
        t = r["timeline"]
        assert t["device"] == "cpu" and t["iterations"] == 2  # iterations 2 and 3
        for name in ("forward", "backward", "optimizer"):
            phase = t["phases"][name]
            assert phase["count"] == (2 if name == "optimizer" else 8)  # 4 micro-batches per iteration
            assert 0 < phase["compute_ms"] <= phase["host_ms"] + eps
        assert sum(p["compute_ms"] for p in t["phases"].values()) <= t["compute_ms"] + eps
        # compute, exposed communication and idle partition the window
        assert abs(t["compute_ms"] + t["exposed_comm_ms"] + t["idle_ms"] - r["wall_ms"]) < 1e-3
        assert min(t["compute_ms"], t["exposed_comm_ms"], t["idle_ms"]) > 0
        pp = t["comm"]["pp_p2p"]  # each stage sends or receives once per micro-batch and direction
        assert pp["count"] >= 8 and 0 < pp["exposed_ms"] <= pp["ms"] + eps
        assert "all_reduce" in t["comm"]  # the gradient and loss reductions
        p = t["pipeline"]
        assert 0 < p["bubble_ms"] <= p["schedule_ms"] <= r["wall_ms"] + eps
        parts = p["bubble_p2p_ms"] + p["bubble_other_comm_ms"] + p["bubble_idle_ms"]
        assert abs(parts - p["bubble_ms"]) < 1e-3 and min(p["bubble_p2p_ms"], p["bubble_idle_ms"]) >= 0
    assert main(paths) == 0
    out = capsys.readouterr().out
    assert "| rank | pp stage | window | forward | backward | optimizer |" in out
    assert "| 0 | 0/2 |" in out and "| 1 | 1/2 |" in out

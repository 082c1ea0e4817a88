"""--log-progress: progress.txt in the --save directory, through pretrain() (a job, then a resumed job), and
the cumulative throughput's start after a change of GPU count."""
import datetime

from megatron.training import progress_log
from tests.fixtures.tiny_gpt import run_pretrain
from tests.parallel.dist_utils import run_distributed

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--vocab-size 128 --tokenizer-type NullTokenizer --mock-data --lr 1e-3 --log-interval 1 --eval-iters 0 "
         "--eval-interval 1000 --num-workers 0 --global-batch-size 4 --micro-batch-size 2 --save-interval 2 "
         "--log-progress --override-opt_param-scheduler")


def _jobs(ckpt):
    flags = f"{MODEL} --save {ckpt} --load {ckpt}"
    run_pretrain((flags + " --train-iters 4").split())
    run_pretrain((flags + " --train-iters 6").split())  # a restart resuming at iteration 4
    return open(f"{ckpt}/progress.txt").read().splitlines()


def test_progress_file_records_jobs_and_checkpoints(tmp_path):
    lines = run_distributed(_jobs, 1, str(tmp_path / "ckpt"))[0]
    events = [line.split("\t")[3] for line in lines]
    assert events == ["Starting job", "Saved checkpoint", "Saved checkpoint", "Starting job", "Saved checkpoint"]
    saves = [dict(f.split(": ", 1) for f in line.split("\t")[3:] if ": " in f) for line in lines if "Saved" in line]
    assert [s["Iteration"] for s in saves] == ["2", "4", "6"]
    flops = [float(s["Floating-point operations"]) for s in saves]
    assert 0 < flops[0] < flops[1] < flops[2] and abs(flops[2] - 3 * flops[0]) < 1e-6 * flops[2]
    assert all(s["Job throughput"].endswith("TFLOP/s/GPU") and "# GPUs: 1" in line
               for s, line in zip(saves, [x for x in lines if "Saved" in x]))


def test_cumulative_throughput_restarts_at_a_new_gpu_count(tmp_path):
    path = tmp_path / "progress.txt"
    t = [datetime.datetime(2026, 1, 1, 0, m).strftime("%Y-%m-%d %H:%M:%S") for m in range(4)]
    path.write_text(f"{t[0]}\tJob ID: 1\t# GPUs: 8\tStarting job\n"
                    f"{t[1]}\tJob ID: 1\t# GPUs: 8\tSaved checkpoint\tIteration: 10\t"
                    "Floating-point operations: 5.00e+15\n"
                    f"{t[2]}\tJob ID: 2\t# GPUs: 16\tStarting job\n"
                    f"{t[3]}\tJob ID: 3\t# GPUs: 16\tStarting job\n")
    start, flops = progress_log._first_start_at_this_size(str(path), 16)
    assert start == datetime.datetime(2026, 1, 1, 0, 2).timestamp() and flops == 5e15
    # Back at 8 GPUs after the 16-GPU jobs: nothing to accumulate from (this job's own start is used).
    assert progress_log._first_start_at_this_size(str(path), 8) is None

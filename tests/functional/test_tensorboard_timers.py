"""--log-timers-to-tensorboard on 2 ranks: the timers' max over ranks is a collective that every rank joins,
though only the last rank holds the TensorBoard writer (it was called on that rank alone, and the run hung in
its first log step; Megatron's own launch scripts pass the flag)."""
import glob

from tests.functional.cli_runner import CliRunner

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-3 --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 128 --log-interval 1 --eval-iters 0 "
         "--log-timers-to-tensorboard --distributed-timeout-seconds-after-init 30").split()


def test_timers_reach_tensorboard_without_a_hang(tmp_path):
    with CliRunner() as cli:
        results = cli.run(["pretrain_gpt.py", *FLAGS, "--tensorboard-dir", str(tmp_path)], nranks=2, timeout=180)
    assert [r.rc for r in results] == [0, 0], results[0].err[-2000:] + results[1].err[-2000:]
    assert "iteration        3/" in results[1].out
    events = glob.glob(str(tmp_path / "events.out.tfevents.*"))
    assert events and any(b"forward-backward-time" in open(path, "rb").read() for path in events)

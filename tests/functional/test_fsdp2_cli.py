"""`pretrain_gpt.py --use-torch-fsdp2` against plain DDP through the real CLI (2 ranks with torchrun's
environment, forked from one module CliRunner; DP=2, fp32).

Same seed, data and dropout 0: five iterations of lm loss and grad norm (read at full precision from
TensorBoard) must agree within 1e-5 relative. The default GPT ties the word embedding to the output
layer and uses gradient-accumulation fusion, so this pins that DDP adds the embedding lookup's grad
(in `.grad`) on top of the fused output-layer wgrad (in `main_grad`), while FSDP2 reduces plain grads.
"""
import pytest
import torch

from tests.functional.cli_runner import CliRunner

ITERS = 5
CMD = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
       f"--micro-batch-size 2 --global-batch-size 8 --train-iters {ITERS} --lr 1e-3 --mock-data "
       "--tokenizer-type NullTokenizer --vocab-size 255 --log-interval 1 --eval-iters 0 --num-workers 0 "
       "--attention-dropout 0 --hidden-dropout 0")
RTOL = 1e-5


def _run(cli, tb_dir, extra):
    results = cli.run(["pretrain_gpt.py"] + CMD.split() + ["--tensorboard-dir", str(tb_dir)] + extra, nranks=2,
                      timeout=300)
    assert [r.rc for r in results] == [0, 0], results[0].err[-3000:] + results[1].err[-3000:]
    return _scalars(str(tb_dir))


def _scalars(tb_dir):
    """{tag: [value per iteration 1..ITERS]} for lm loss and grad norm."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(tb_dir)
    acc.Reload()
    out = {}
    for tag in ("lm loss", "grad-norm"):
        events = sorted(acc.Scalars(tag), key=lambda e: e.step)
        assert [e.step for e in events] == list(range(1, ITERS + 1)), (tag, [e.step for e in events])
        out[tag] = [e.value for e in events]
    return out


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    with CliRunner() as cli:
        return (_run(cli, tmp_path_factory.mktemp("ddp"), []),
                _run(cli, tmp_path_factory.mktemp("fsdp2"), ["--use-torch-fsdp2"]))


@pytest.mark.parametrize("tag", ["lm loss", "grad-norm"])
def test_fsdp2_matches_ddp(curves, tag):
    ddp, fsdp2 = curves
    torch.testing.assert_close(torch.tensor(fsdp2[tag], dtype=torch.float64),
                               torch.tensor(ddp[tag], dtype=torch.float64), rtol=RTOL, atol=0,
                               msg=lambda m: f"{tag} (FSDP2 vs DDP) {fsdp2[tag]} vs {ddp[tag]}: {m}")
    assert len(set(ddp[tag])) == ITERS  # the run trains: every iteration reports a new value

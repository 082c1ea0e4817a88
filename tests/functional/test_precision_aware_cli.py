"""`pretrain_gpt.py --use-precision-aware-optimizer` as a user runs it (2 ranks, --bf16, the distributed optimizer,
bf16 gradients and moments; mock data): the loss falls as with the default fp32 state."""
import re

import pytest

from tests.functional.cli_runner import CliRunner

CMD = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
       "--position-embedding-type rope --micro-batch-size 2 --global-batch-size 8 --train-iters 12 --lr 3e-3 "
       "--lr-warmup-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 512 --log-interval 1 "
       "--eval-iters 0 --num-workers 0 --bf16 --use-distributed-optimizer")
LOSS = re.compile(r"iteration +(\d+)/ +12 \|.* lm loss: (\S+) \|")
LOW = "--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


def test_bf16_state_trains_like_fp32_state(cli):
    losses = {}
    for name, extra in (("fp32", ""), ("bf16", LOW)):
        results = cli.run(["pretrain_gpt.py"] + CMD.split() + extra.split(), nranks=2, timeout=300)
        assert [r.rc for r in results] == [0, 0], results[0].err[-3000:] + results[1].err[-3000:]
        losses[name] = [float(m.group(2)) for m in LOSS.finditer(results[-1].out)]
    assert len(losses["bf16"]) == 12 and losses["bf16"][-1] < 0.9 * losses["bf16"][0], losses
    assert abs(losses["bf16"][-1] - losses["fp32"][-1]) < 0.01 * losses["fp32"][-1], losses

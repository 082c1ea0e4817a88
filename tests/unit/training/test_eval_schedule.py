"""--start-eval-at-iter (no evaluation before it; the validation split sized without those evaluations) and the
NullTokenizer's --null-tokenizer-eod-id / --null-tokenizer-pad-id."""
import re

import pytest

from tests.fixtures.tiny_gpt import run_pretrain
from tests.parallel.dist_utils import run_distributed

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--vocab-size 128 --tokenizer-type NullTokenizer --mock-data --lr 1e-3 --log-interval 1 --eval-iters 1 "
         "--eval-interval 1 --num-workers 0 --global-batch-size 4 --micro-batch-size 2 --train-iters 4")


def _log(extra):
    return run_pretrain((MODEL + " " + extra).split(), capture_stdout=True)


def test_evaluations_start_at_the_given_iteration():
    plain, late = (run_distributed(_log, 1, extra)[0] for extra in ("", "--start-eval-at-iter 3"))
    evaluated = lambda log: [int(i) for i in re.findall(r"validation loss at iteration (\d+) \|", log)]  # noqa
    assert evaluated(plain) == [1, 2, 3, 4] and evaluated(late) == [3, 4]
    sizes = lambda log: int(re.search(r"validation: +(\d+)", log).group(1))  # noqa: E731
    # Megatron's count: train_iters // interval + 1 points, less start // interval (the validation iterator cycles)
    assert sizes(plain) == 5 * 4 and sizes(late) == 2 * 4


def test_null_tokenizer_ids():
    from megatron.training.tokenizer.bpe_tokenizers import _NullTokenizer
    assert (_NullTokenizer(100).eod, _NullTokenizer(100).pad) == (99, -1)
    tok = _NullTokenizer(100, eod_id=0, pad_id=7)
    assert (tok.eod, tok.pad) == (0, 7)
    with pytest.raises(ValueError, match="--null-tokenizer-eod-id 100 is outside the vocabulary"):
        _NullTokenizer(100, eod_id=100)

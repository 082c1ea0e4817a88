"""pretrain_t5.py end to end on the shipped corpus: preprocess with --split-sentences (cased WordPiece,
sentinels), train at TP=2 on 2 ranks with torchrun's environment with different encoder/decoder depths,
evaluate; lm loss falls."""
import argparse
import os
import re
import sys

import pytest

from tests.functional.test_pretrain_bert import ROOT, preprocess_corpus, run_ranks

ITERS = 10
CMD = (f"--encoder-num-layers 2 --decoder-num-layers 1 --hidden-size 64 --num-attention-heads 4 "
       f"--encoder-seq-length 128 --decoder-seq-length 64 --max-position-embeddings 128 --micro-batch-size 4 "
       f"--global-batch-size 16 --train-iters {ITERS} --lr 5e-3 --lr-warmup-iters 2 --split 98,1,1 "
       "--log-interval 1 --eval-interval 5 --eval-iters 2 --num-workers 0 --tensor-model-parallel-size 2")
LOSS = re.compile(rf" iteration +(\d+)/ +{ITERS} \| .* \| lm loss: (\S+) \| loss scale: 1\.0 \|")


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("t5_cli")
    vocab = os.path.join(ROOT, "data", "bert-vocab-cased.txt")
    prefix = preprocess_corpus(str(tmp), vocab, "BertWordPieceCase")
    rcs, out, err = run_ranks("pretrain_t5.py", CMD.split() + ["--data-path", prefix, "--vocab-file", vocab])
    assert rcs == [0, 0], out[-3000:] + err[-3000:]
    return out


def test_lm_loss_logged_and_falls(out):
    rows = [LOSS.search(line) for line in out.splitlines()]
    rows = [(int(m.group(1)), float(m.group(2))) for m in rows if m]
    assert [r[0] for r in rows] == list(range(1, ITERS + 1))
    lm = [r[1] for r in rows]
    assert sum(lm[-3:]) / 3 < lm[0] - 1.0, lm  # ~9.07 -> ~7.67 (last 3)


def test_validation_lines(out):
    assert re.search(r"^ validation loss at iteration 5 \| lm loss value: \S+ \| lm loss PPL: \S+ \| $", out, re.M)
    assert re.search(r"^ validation loss at iteration 10 on test set \| lm loss value: ", out, re.M)


def test_t5_flag_checks():
    sys.path.insert(0, ROOT)
    from pretrain_t5 import _args_defaults, check_t5_args
    base = dict(decoder_seq_length=64, seq_length=128, max_position_embeddings=128, pipeline_model_parallel_size=1,
                sequence_parallel=False, context_parallel_size=1, recompute_granularity=None,
                num_layers=3, encoder_num_layers=None, decoder_num_layers=2)
    args = argparse.Namespace(**base)
    check_t5_args(args)
    assert (args.encoder_num_layers, args.decoder_num_layers) == (3, 2)
    for change, needle in ((dict(decoder_seq_length=None), "--decoder-seq-length is required"),
                           (dict(max_position_embeddings=64), "--max-position-embeddings"),
                           (dict(pipeline_model_parallel_size=2), "--pipeline-model-parallel-size"),
                           (dict(recompute_granularity="full"), "recompute")):
        with pytest.raises(ValueError, match=needle):
            check_t5_args(argparse.Namespace(**{**base, **change}))
    assert _args_defaults(["--encoder-num-layers", "4"])["num_layers"] == 4
    assert "num_layers" not in _args_defaults(["--num-layers", "2", "--encoder-num-layers", "4"])

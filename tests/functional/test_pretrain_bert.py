"""pretrain_bert.py end to end on the shipped corpus: preprocess with --split-sentences, train at
PP=2 on 2 ranks with torchrun's environment (every stage reads the padding mask), evaluate, save; lm loss and
sop loss are logged and the lm loss falls. TP is covered by tests/parallel/test_bert_tp_invariance.py and the
T5 CLI test."""
import os
import re
import subprocess
import sys

import pytest

from tests.functional.cli_runner import CliRunner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERS = 10
CMD = (f"--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
       f"--micro-batch-size 4 --global-batch-size 16 --train-iters {ITERS} --lr 5e-3 --lr-warmup-iters 2 "
       "--split 98,1,1 --log-interval 1 --eval-interval 5 --eval-iters 2 --num-workers 0 "
       f"--pipeline-model-parallel-size 2 --save-interval {ITERS}")
LOSSES = re.compile(rf" iteration +(\d+)/ +{ITERS} \| .* \| lm loss: (\S+) \| sop loss: (\S+) \| loss scale: 1\.0 \|")


def preprocess_corpus(out_dir, vocab, tokenizer_type):
    prefix = os.path.join(out_dir, "corpus")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
                    os.path.join(ROOT, "data", "corpus.jsonl.gz"), "--output-prefix", prefix, "--tokenizer-type",
                    tokenizer_type, "--vocab-file", vocab, "--split-sentences", "--workers", "1"],
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": ROOT})
    return prefix + "_text_sentence"


def run_ranks(script, args, nproc=2):
    """``script`` on ``nproc`` ranks forked from a CliRunner (torchrun's environment, without its launcher and
    per-rank imports): (exit codes, every rank's stdout as torchrun would merge it, every rank's stderr)."""
    with CliRunner() as cli:
        results = cli.run([script] + args, nranks=nproc, timeout=300)
    return [r.rc for r in results], "".join(r.out for r in results), "".join(r.err for r in results)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bert_cli")
    prefix = preprocess_corpus(str(tmp), os.path.join(ROOT, "data", "bert-vocab.txt"), "BertWordPieceLowerCase")
    args = CMD.split() + ["--data-path", prefix, "--vocab-file", os.path.join(ROOT, "data", "bert-vocab.txt"),
                          "--save", str(tmp / "ckpt")]
    rcs, out, err = run_ranks("pretrain_bert.py", args)
    assert rcs == [0, 0], out[-3000:] + err[-3000:]
    return out, tmp


def test_lm_and_sop_loss_logged_and_lm_loss_falls(run):
    out, _ = run
    rows = [LOSSES.search(line) for line in out.splitlines()]
    rows = [(int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in rows if m]
    assert [r[0] for r in rows] == list(range(1, ITERS + 1))
    lm = [r[1] for r in rows]
    assert sum(lm[-3:]) / 3 < lm[0] - 0.7, lm  # ~9.02 -> ~7.99 (last 3)
    assert all(0.3 < r[2] < 1.2 for r in rows)  # sentence order: near ln 2 early on


def test_validation_lines_and_checkpoint(run):
    out, tmp = run
    assert re.search(r"^ validation loss at iteration 5 \| lm loss value: \S+ \| lm loss PPL: \S+ \| "
                     r"sop loss value: \S+ \| sop loss PPL: \S+ \| $", out, re.M)
    assert re.search(r"^ validation loss at iteration 10 on test set \| lm loss value: ", out, re.M)
    assert open(tmp / "ckpt" / "latest_checkpointed_iteration.txt").read().strip() == str(ITERS)


def test_unsupported_layouts_rejected_with_clear_error():
    import argparse
    sys.path.insert(0, ROOT)
    from pretrain_bert import check_bert_args
    base = dict(virtual_pipeline_model_parallel_size=None, sequence_parallel=False, context_parallel_size=1)
    check_bert_args(argparse.Namespace(**base))
    for change, needle in ((dict(virtual_pipeline_model_parallel_size=2), "virtual pipeline"),
                           (dict(sequence_parallel=True), "--sequence-parallel")):
        with pytest.raises(ValueError, match=needle):
            check_bert_args(argparse.Namespace(**{**base, **change}))

"""--full-validation, --multiple-validation-sets and --validation-set-names through pretrain_gpt.py on tiny indexed
corpora: each validation set gets its own loss line, and a full validation's loss is that of the whole set, each
sample counted once: the same at DP=1 with micro-batches of 1 (no padding) as at DP=2 with micro-batches of 2 (the
last batches padded with masked samples), on sets whose sizes divide neither."""
import re

import numpy
import pytest

from tests.functional.cli_runner import CliRunner

SEQ, VOCAB = 16, 128
LINE = re.compile(r" validation(\S*) loss at iteration (\d+) \| lm loss value: (\S+) \|")


def _corpus(path, docs, seed):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(str(path) + ".bin", dtype=numpy.uint16)
    for _ in range(docs):
        builder.add_item(rng.integers(1, VOCAB, size=int(rng.integers(5, 40))))
        builder.end_document()
    builder.finalize(str(path) + ".idx")
    return str(path)


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:
        yield runner


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    return _corpus(root / "train", 200, 0), _corpus(root / "web", 23, 1), _corpus(root / "code", 17, 2)


def _run(cli, tmp_path, corpora, extra, nranks):
    train, web, code = corpora
    argv = (f"pretrain_gpt.py --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length {SEQ} "
            f"--max-position-embeddings {SEQ} --global-batch-size 4 --train-iters 4 --eval-interval 2 --lr 0 "
            f"--min-lr 0 --tokenizer-type NullTokenizer --vocab-size {VOCAB} --log-interval 1 --num-workers 0 "
            f"--data-cache-path {tmp_path}/cache --train-data-path {train} --valid-data-path {web} {code} "
            f"--full-validation --seed 7").split() + extra.split()
    runs = cli.run(argv, nranks=nranks, timeout=240)
    assert all(r.rc == 0 for r in runs), runs[0].err[-3000:] + runs[-1].err[-3000:]
    return {(name, int(it)): float(loss) for name, it, loss in LINE.findall(runs[-1].out)}


def test_each_set_whole_and_named_the_same_at_any_layout(cli, tmp_path, corpora):
    # --lr 0: the weights stay the initial ones, so the layouts differ only in how the sets are read.
    flags = "--multiple-validation-sets --validation-set-names web code"
    one = _run(cli, tmp_path / "a", corpora, f"--micro-batch-size 1 {flags}", 1)
    two = _run(cli, tmp_path / "b", corpora, f"--micro-batch-size 2 {flags}", 2)
    # Evaluated at iterations 2 and 4 (the loop) and once more at the end ("on validation set" lines aside).
    assert {("-web", 2), ("-code", 2), ("-web", 4), ("-code", 4)} <= set(one), one
    assert set(one) == set(two)
    for key, loss in one.items():
        assert abs(two[key] - loss) <= 1e-5 * abs(loss), (key, loss, two[key])
    assert one[("-web", 2)] != one[("-code", 2)]


def test_one_set_whole_without_multiple_sets(cli, tmp_path, corpora):
    train, web, _ = corpora
    losses = _run(cli, tmp_path, (train, web, ""), "--micro-batch-size 2", 2)
    assert ("", 2) in losses and ("", 4) in losses, losses

"""The C++ index helpers equal slow pure-Python references on random inputs (exact equality)."""
import numpy
import pytest

from megatron.core.datasets import helpers
from tests.unit.core.datasets import reference_helpers as ref


@pytest.mark.parametrize("trial", range(6))
@pytest.mark.parametrize("extra", [0, 1])
def test_build_sample_idx(trial, extra):
    rng = numpy.random.default_rng(trial)
    sizes = rng.integers(1, 40, size=rng.integers(1, 30)).astype(numpy.int32)
    epochs = int(rng.integers(1, 4))
    doc_idx = numpy.tile(numpy.arange(len(sizes), dtype=numpy.int32), epochs)
    rng.shuffle(doc_idx)
    seq_len = int(rng.integers(1, 50))
    tokens_per_epoch = int(sizes.sum())
    for drop_last in (True, False):
        if epochs * tokens_per_epoch - extra < seq_len and drop_last:
            continue
        got = helpers.build_sample_idx(sizes, doc_idx, seq_len, epochs, tokens_per_epoch, drop_last, extra)
        want = ref.build_sample_idx(sizes, doc_idx, seq_len, epochs, tokens_per_epoch, drop_last, extra)
        numpy.testing.assert_array_equal(got, want)
        assert got.dtype == numpy.int32


def test_build_sample_idx_known_values():
    sizes = numpy.array([5, 3, 7], dtype=numpy.int32)
    got = helpers.build_sample_idx(sizes, numpy.arange(3, dtype=numpy.int32), 4, 1, 15)
    numpy.testing.assert_array_equal(got, [[0, 0], [0, 4], [2, 0], [2, 4]])


@pytest.mark.parametrize("trial", range(5))
def test_build_blending_indices(trial):
    rng = numpy.random.default_rng(100 + trial)
    n = int(rng.integers(1, 6))
    weights = rng.random(n)
    weights /= weights.sum()
    size = int(rng.integers(1, 500))
    index = numpy.zeros(size, dtype=numpy.int16)
    sample_index = numpy.zeros(size, dtype=numpy.int64)
    helpers.build_blending_indices(index, sample_index, weights, n, size, False)
    want_index, want_sample = ref.build_blending_indices(weights.tolist(), size)
    numpy.testing.assert_array_equal(index, want_index)
    numpy.testing.assert_array_equal(sample_index, want_sample)


@pytest.mark.parametrize("trial", range(5))
def test_build_exhaustive_blending_indices(trial):
    rng = numpy.random.default_rng(200 + trial)
    sizes = rng.integers(1, 80, size=int(rng.integers(1, 6))).astype(numpy.int64)
    total = int(sizes.sum())
    index = numpy.zeros(total, dtype=numpy.int16)
    sample_index = numpy.zeros(total, dtype=numpy.int64)
    helpers.build_exhaustive_blending_indices(index, sample_index, sizes, len(sizes))
    want_index, want_sample = ref.build_exhaustive_blending_indices(sizes.tolist())
    numpy.testing.assert_array_equal(index, want_index)
    numpy.testing.assert_array_equal(sample_index, want_sample)
    assert numpy.bincount(index, minlength=len(sizes)).tolist() == sizes.tolist()


@pytest.mark.parametrize("trial", range(4))
def test_build_mapping(trial):
    rng = numpy.random.default_rng(300 + trial)
    num_docs = int(rng.integers(1, 40))
    sents = rng.integers(0, 8, size=num_docs)
    docs = numpy.concatenate([[0], numpy.cumsum(sents)]).astype(numpy.int64)
    sizes = rng.integers(1, 60, size=int(docs[-1])).astype(numpy.int32)
    if len(sizes):
        sizes[rng.random(len(sizes)) < 0.02] = 600  # some documents with over-long sentences
    args = dict(num_epochs=int(rng.integers(1, 4)), max_samples=int(rng.integers(1, 200)),
                max_seq_len=int(rng.integers(2, 128)), short_seq_prob=[0.0, 0.1, 0.5][trial % 3],
                seed=int(rng.integers(1, 1000)), min_num_sent=int(rng.integers(1, 3)))
    got = helpers.build_mapping(docs, sizes, args["num_epochs"], args["max_samples"], args["max_seq_len"],
                                args["short_seq_prob"], args["seed"], False, args["min_num_sent"])
    want = ref.build_mapping(docs, sizes, **args)
    assert got.dtype == numpy.uint32
    numpy.testing.assert_array_equal(got.astype(numpy.int64), want)


def test_reference_twisters_match_known_outputs():
    # the 10000th output of default-seeded std::mt19937 / mt19937_64 is fixed by the C++ standard
    g32, g64 = ref.MT19937(5489), ref.MT19937_64(5489)
    for _ in range(9999):
        g32(), g64()
    assert g32() == 4123659995
    assert g64() == 9981545732273789042

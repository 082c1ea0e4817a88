"""BERT masked-LM dataset on sentence-split data from the real preprocessing tool (COMPAT.md 4.7)."""
import gzip
import os
import subprocess
import sys

import numpy
import pytest

from tests import ROOT

N_SAMPLES = 400


def preprocess_subset(tmp_dir, vocab, tokenizer_type, num_docs=1200):
    """The first ``num_docs`` corpus documents through tools/preprocess_data.py --split-sentences."""
    src = os.path.join(tmp_dir, "subset.jsonl")
    with gzip.open(os.path.join(ROOT, "data", "corpus.jsonl.gz"), "rt") as f, open(src, "w") as out:
        for _, line in zip(range(num_docs), f):
            out.write(line)
    prefix = os.path.join(tmp_dir, "corpus")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", src,
                    "--output-prefix", prefix, "--tokenizer-type", tokenizer_type, "--vocab-file", vocab,
                    "--split-sentences", "--workers", "1"], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": ROOT})
    return prefix + "_text_sentence"


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    return preprocess_subset(str(tmp_path_factory.mktemp("bert")), os.path.join(ROOT, "data", "bert-vocab.txt"),
                             "BertWordPieceLowerCase")


@pytest.fixture(scope="module")
def tokenizer():
    from megatron.training.tokenizer.bert_tokenization import _BertWordPieceTokenizer
    return _BertWordPieceTokenizer(os.path.join(ROOT, "data", "bert-vocab.txt"), lower_case=True)


def _config(tokenizer, cache, binary_head=True, seq=64, seed=1234, blend=None, split="98,1,1"):
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig
    return BERTMaskedWordPieceDatasetConfig(
        random_seed=seed, sequence_length=seq, blend=blend, split=split, path_to_cache=cache,
        tokenizer=tokenizer, masking_probability=0.15, short_sequence_probability=0.1, masking_max_ngram=3,
        masking_do_full_word=True, masking_do_permutation=False, masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False, classification_head=binary_head)


def _build(prefix, tokenizer, cache, binary_head=True, seq=64, seed=1234):
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    cfg = _config(tokenizer, cache, binary_head, seq, seed, blend=([prefix], None))
    return BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, [N_SAMPLES, 20, 20], lambda: True,
                                         cfg).build()


def _build_mock(tokenizer, binary_head=True, seed=1234, split="949,50,1"):
    """--mock-data: synthetic sentences, no blend, indices built in memory (no cache path)."""
    from megatron.core.datasets.bert_dataset import MockBERTMaskedWordPieceDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    cfg = _config(tokenizer, None, binary_head, seed=seed, split=split)
    return BlendedMegatronDatasetBuilder(MockBERTMaskedWordPieceDataset, [N_SAMPLES, 20, 20], lambda: True,
                                         cfg).build()


@pytest.fixture(scope="module", params=["corpus", "mock"])
def samples(request, tokenizer, tmp_path_factory):
    """The same sample checks hold for the preprocessed corpus and for --mock-data's synthetic text."""
    if request.param == "mock":
        train, _, _ = _build_mock(tokenizer)
    else:
        train, _, _ = _build(request.getfixturevalue("data_prefix"), tokenizer, str(tmp_path_factory.mktemp("cache")))
    return [train[i] for i in range(N_SAMPLES)]


def test_mask_rate_and_80_10_10(samples, tokenizer):
    masked = real = as_mask = unchanged = 0
    for s in samples:
        pos = s["loss_mask"] == 1
        masked += pos.sum()
        real += s["padding_mask"].sum()
        as_mask += (s["text"][pos] == tokenizer.mask).sum()
        unchanged += (s["text"][pos] == s["labels"][pos]).sum()
        assert (s["labels"][~pos] == -1).all() and (s["labels"][pos] >= 0).all()
    assert abs(masked / real - 0.15) < 0.01, masked / real
    assert abs(as_mask / masked - 0.8) < 0.03
    assert abs(unchanged / masked - 0.1) < 0.03
    assert abs((masked - as_mask - unchanged) / masked - 0.1) < 0.03


def test_pair_layout_types_padding_and_sop(samples, tokenizer):
    for s in samples:
        n = int(s["padding_mask"].sum())
        text, types = s["text"], s["types"]
        assert (s["padding_mask"][:n] == 1).all() and (s["padding_mask"][n:] == 0).all()
        assert text[0] == tokenizer.cls and text[n - 1] == tokenizer.sep and (text[n:] == tokenizer.pad).all()
        seps = numpy.flatnonzero(text[:n] == tokenizer.sep)
        assert len(seps) == 2  # [CLS] A [SEP] B [SEP] ([SEP] is never masked)
        assert (types[:seps[0] + 1] == 0).all() and (types[seps[0] + 1:n] == 1).all() and (types[n:] == 0).all()
        assert s["loss_mask"][[0, *seps]].sum() == 0
    assert 0.4 < numpy.mean([s["is_random"] for s in samples]) < 0.6


def test_whole_word_masking(samples, tokenizer):
    """A masked '##' piece implies the piece before it (same word) is masked too."""
    for s in samples:
        for i in numpy.flatnonzero(s["loss_mask"]):
            if tokenizer.inv_vocab[int(s["labels"][i])].startswith("##"):
                assert s["loss_mask"][i - 1] == 1


def test_deterministic_and_cached(data_prefix, tokenizer, tmp_path):
    train, _, _ = _build(data_prefix, tokenizer, str(tmp_path))
    samples = [train[i] for i in range(N_SAMPLES)]
    files = sorted(os.listdir(tmp_path))
    assert any(f.endswith("-BERTMaskedWordPieceDataset-train-sample_index.npy") for f in files), files
    again, _, _ = _build(data_prefix, tokenizer, str(tmp_path))
    assert not again.built_anew_on_cache_miss
    for i in (0, 7, N_SAMPLES - 1):
        for key in samples[i]:
            numpy.testing.assert_array_equal(again[i][key], samples[i][key])
    other, _, _ = _build(data_prefix, tokenizer, str(tmp_path), seed=99)
    assert any((other[i]["text"] != samples[i]["text"]).any() for i in range(5))


def test_mock_data_is_seeded_and_uses_ordinary_tokens(tokenizer):
    train, valid, test = _build_mock(tokenizer)
    assert len(train) >= N_SAMPLES and len(valid) >= 20 and len(test) >= 20
    again, _, _ = _build_mock(tokenizer)
    for i in (0, 7, N_SAMPLES - 1):
        for key, value in train[i].items():
            numpy.testing.assert_array_equal(again[i][key], value)
    other, _, _ = _build_mock(tokenizer, seed=99)
    assert any((other[i]["text"] != train[i]["text"]).any() for i in range(5))
    special = {tokenizer.cls, tokenizer.sep, tokenizer.pad, tokenizer.mask}
    for i in range(50):
        s = train[i]
        assert not special & set(s["labels"][s["loss_mask"] == 1].tolist())
    assert not train.built_anew_on_cache_miss  # nothing cached without --data-cache-path
    no_head, _, _ = _build_mock(tokenizer, binary_head=False)
    assert all(no_head[i]["is_random"] == 0 for i in range(20))


def test_mock_dataset_refuses_a_blend(data_prefix, tokenizer):
    from megatron.core.datasets.bert_dataset import MockBERTMaskedWordPieceDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    cfg = _config(tokenizer, None, blend=([data_prefix], None))
    with pytest.raises(ValueError, match="mock data"):
        BlendedMegatronDatasetBuilder(MockBERTMaskedWordPieceDataset, [N_SAMPLES, 20, 20], lambda: True,
                                      cfg).build()


def test_no_binary_head_single_segment(data_prefix, tokenizer, tmp_path):
    train, _, _ = _build(data_prefix, tokenizer, str(tmp_path), binary_head=False)
    for i in range(50):
        s = train[i]
        n = int(s["padding_mask"].sum())
        assert s["is_random"] == 0 and (s["types"] == 0).all()
        assert (s["text"][:n] == tokenizer.sep).sum() == 1 and s["text"][n - 1] == tokenizer.sep


def test_bad_mask_prob_rejected(tokenizer, tmp_path):
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig
    with pytest.raises(ValueError, match="--mask-prob"):
        BERTMaskedWordPieceDatasetConfig(
            random_seed=1, sequence_length=64, blend=(["x"], None), split="1", tokenizer=tokenizer,
            masking_probability=1.5, short_sequence_probability=0.1, masking_max_ngram=3,
            masking_do_full_word=True, masking_do_permutation=False, masking_use_longer_ngrams=False,
            masking_use_geometric_distribution=False, classification_head=True)

"""T5 span-corruption dataset on sentence-split data from the real preprocessing tool (COMPAT.md 4.8)."""
import os

import numpy
import pytest

from tests.unit.core.datasets.test_bert_dataset import ROOT, preprocess_subset

N_SAMPLES, ENC, DEC = 400, 128, 64


@pytest.fixture(scope="module")
def tokenizer():
    from megatron.training.tokenizer.bert_tokenization import _BertWordPieceTokenizer
    return _BertWordPieceTokenizer(os.path.join(ROOT, "data", "bert-vocab-cased.txt"), lower_case=False)


def _config(tokenizer, cache=None, blend=None, seed=1234, split="98,1,1"):
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDatasetConfig
    return T5MaskedWordPieceDatasetConfig(
        random_seed=seed, sequence_length=ENC, sequence_length_encoder=ENC, sequence_length_decoder=DEC,
        blend=blend, split=split, path_to_cache=cache, tokenizer=tokenizer,
        masking_probability=0.15, short_sequence_probability=0.1, masking_max_ngram=10,
        masking_do_full_word=False, masking_do_permutation=False, masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=True)


def _build_mock(tokenizer, seed=1234):
    """--mock-data: synthetic sentences, no blend, indices built in memory."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.t5_dataset import MockT5MaskedWordPieceDataset
    return BlendedMegatronDatasetBuilder(MockT5MaskedWordPieceDataset, [N_SAMPLES, 20, 20], lambda: True,
                                         _config(tokenizer, seed=seed, split="99982,9,9")).build()


@pytest.fixture(scope="module", params=["corpus", "mock"])
def dataset(request, tmp_path_factory, tokenizer):
    """The same sample checks hold for the preprocessed corpus and for --mock-data's synthetic text."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset
    if request.param == "mock":
        return _build_mock(tokenizer)[0]
    tmp = str(tmp_path_factory.mktemp("t5"))
    prefix = preprocess_subset(tmp, os.path.join(ROOT, "data", "bert-vocab-cased.txt"), "BertWordPieceCase")
    cfg = _config(tokenizer, os.path.join(tmp, "cache"), ([prefix], None))
    train, _, _ = BlendedMegatronDatasetBuilder(T5MaskedWordPieceDataset, [N_SAMPLES, 20, 20], lambda: True,
                                                cfg).build()
    return train


def _parse(sample, sentinels):
    """(encoder tokens, decoder input, spans as token lists in sentinel order)."""
    enc = sample["text_enc"][:sample["enc_mask"].sum()].tolist()
    dec = sample["text_dec"][:sample["dec_mask"].sum()].tolist()
    spans = []
    for t in dec[1:]:
        if t in sentinels:
            spans.append([])
        else:
            spans[-1].append(t)
    return enc, dec, spans


def test_sentinel_structure_reconstructs_the_text(dataset, tokenizer):
    ids = tokenizer.additional_special_tokens_ids
    sentinels = set(ids)
    for i in range(N_SAMPLES):
        s = dataset[i]
        enc, dec, spans = _parse(s, sentinels)
        used = [t for t in enc if t in sentinels]
        assert used == ids[:len(spans)] == [t for t in dec if t in sentinels]  # <extra_id_0>, 1, ... in order
        assert dec[0] == tokenizer.bos
        n = len(dec)
        assert s["labels"][:n].tolist() == dec[1:] + [tokenizer.eos] and (s["labels"][n:] == -1).all()
        assert (s["loss_mask"][:n] == 1).all() and (s["loss_mask"][n:] == 0).all()
        assert (s["text_enc"][len(enc):] == tokenizer.pad).all() and (s["text_dec"][n:] == tokenizer.pad).all()
        # filling each sentinel with its span gives back the sample's original (truncated) text
        beg, end, target = (int(x) for x in dataset.sample_index[i])
        original = [int(t) for j in range(beg, end) for t in dataset.dataset[j]][:target]
        rebuilt, spans_left = [], list(spans)
        for t in enc:
            rebuilt += spans_left.pop(0) if t in sentinels else [t]
        assert rebuilt == original


def test_mask_rate_and_geometric_span_lengths(dataset, tokenizer):
    sentinels = set(tokenizer.additional_special_tokens_ids)
    masked = total = 0
    lengths = []
    for i in range(N_SAMPLES):
        enc, dec, spans = _parse(dataset[i], sentinels)
        n_masked = sum(map(len, spans))
        masked += n_masked
        total += len(enc) - len(spans) + n_masked
        lengths += [len(sp) for sp in spans]
    assert abs(masked / total - 0.15) < 0.01, masked / total
    # Geometric(0.2) clipped to 10 has mean 4.46; spans shrink to fit the 15% budget, giving ~3.3
    assert 1 <= min(lengths) and max(lengths) <= 10
    assert 2.8 < numpy.mean(lengths) < 4.0, numpy.mean(lengths)
    assert numpy.mean(numpy.array(lengths) == 1) < 0.5  # not single-token masking


def test_decoder_too_short_is_a_clear_error(dataset):
    from dataclasses import replace
    short = type(dataset).__new__(type(dataset))
    short.__dict__.update(dataset.__dict__)
    short.config = replace(dataset.config, sequence_length_decoder=4)
    with pytest.raises(ValueError, match="--decoder-seq-length"):
        for i in range(50):
            short[i]


def test_mock_data_is_seeded(tokenizer):
    train, valid, test = _build_mock(tokenizer)
    assert len(train) >= N_SAMPLES and len(valid) >= 20 and len(test) >= 20
    again, other = _build_mock(tokenizer)[0], _build_mock(tokenizer, seed=99)[0]
    for i in (0, 7, N_SAMPLES - 1):
        for key, value in train[i].items():
            numpy.testing.assert_array_equal(again[i][key], value)
    assert any((other[i]["text_enc"] != train[i]["text_enc"]).any() for i in range(5))

"""GPTDataset / BlendedDataset / builder semantics on small hand-built `.bin/.idx` files; the document
offsets that per-document attention (--reset-attention-mask) reads."""
import os

import numpy
import pytest
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset, _document_offsets
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.datasets.utils import get_blend_from_list
from megatron.training.tokenizer.tokenizer import _NullTokenizer

VOCAB = 1000
EOD = VOCAB - 1


def _write_dataset(prefix, num_docs, seed):
    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    docs = []
    for _ in range(num_docs):
        doc = numpy.append(rng.integers(0, EOD, size=int(rng.integers(1, 40))), EOD)
        builder.add_item(doc)
        builder.end_document()
        docs.append(doc)
    builder.finalize(prefix + ".idx")
    return docs


def _config(tmp_path, blend, seed=1234, seq=16, **kw):
    return GPTDatasetConfig(random_seed=seed, sequence_length=seq, blend=blend, split=kw.pop("split", "90,8,2"),
                            path_to_cache=str(tmp_path / "cache"), tokenizer=_NullTokenizer(vocab_size=VOCAB),
                            reset_position_ids=kw.pop("reset_position_ids", False),
                            reset_attention_mask=kw.pop("reset_attention_mask", False),
                            eod_mask_loss=kw.pop("eod_mask_loss", False), **kw)


def _reference_order(docs, indices, num_samples, seq, seed):
    """Megatron's procedure written out: epochs, shuffled document index, token windows, shuffled samples."""
    tokens_per_epoch = sum(len(docs[i]) for i in indices)
    epochs = 1
    while epochs * tokens_per_epoch < num_samples * seq + 1:
        epochs += 1
    rs = numpy.random.RandomState(seed)
    sans_final = ((epochs - 1) * tokens_per_epoch - 1) // seq
    per_epoch = (tokens_per_epoch - 1) // seq
    separate = epochs > 1 and num_samples - sans_final < int(0.8 * per_epoch)
    if separate:
        first = numpy.tile(indices, epochs - 1).astype(numpy.int32)
        rs.shuffle(first)
        last = numpy.array(indices, dtype=numpy.int32)
        rs.shuffle(last)
        doc_index = numpy.concatenate([first, last])
    else:
        doc_index = numpy.tile(indices, epochs).astype(numpy.int32)
        rs.shuffle(doc_index)
    stream = numpy.concatenate([docs[d] for d in doc_index])
    total = (len(stream) - 1) // seq
    windows = [stream[i * seq:(i + 1) * seq + 1] for i in range(total)]
    if separate:
        a = numpy.arange(sans_final, dtype=numpy.uint32)
        rs.shuffle(a)
        b = numpy.arange(sans_final, total, dtype=numpy.uint32)
        rs.shuffle(b)
        shuffle = numpy.concatenate([a, b])
    else:
        shuffle = numpy.arange(total, dtype=numpy.uint32)
        rs.shuffle(shuffle)
    return [windows[j] for j in shuffle]


@pytest.mark.parametrize("num_samples", [20, 300, 700])
def test_samples_match_reference_procedure(tmp_path, num_samples):
    prefix = str(tmp_path / "ds")
    docs = _write_dataset(prefix, 50, seed=0)
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, [num_samples, 10, 5], lambda: True, _config(tmp_path, ([prefix], None))).build()
    assert train.indices.tolist() == list(range(0, 45)) and valid.indices.tolist() == list(range(45, 49))
    want = _reference_order(docs, numpy.arange(45), num_samples, 16, 1234)
    assert len(train) == len(want) >= num_samples
    for i in range(len(train)):
        sample = train[i]
        numpy.testing.assert_array_equal(sample["tokens"].numpy(), want[i][:-1])
        numpy.testing.assert_array_equal(sample["labels"].numpy(), want[i][1:])


def test_determinism_extra_token_and_cache_reuse(tmp_path):
    prefix = str(tmp_path / "ds")
    _write_dataset(prefix, 60, seed=1)
    build = lambda seed: BlendedMegatronDatasetBuilder(
        GPTDataset, [100, 10, 5], lambda: True, _config(tmp_path, ([prefix], None), seed=seed)).build()[0]
    a, b, c = build(7), build(7), build(8)
    assert a.built_anew_on_cache_miss and not b.built_anew_on_cache_miss  # second build loads the cache
    assert len(os.listdir(tmp_path / "cache")) == 4 * 3 * 2  # 4 files x 3 splits x 2 seeds
    assert all(numpy.array_equal(a[i]["tokens"], b[i]["tokens"]) for i in range(len(a)))
    assert not all(numpy.array_equal(a[i]["tokens"], c[i]["tokens"]) for i in range(len(a)))
    # consecutive windows overlap by the extra token: sample j's last label starts sample j+1
    for j in range(len(a) - 1):
        ja, jb = a.shuffle_index.tolist().index(j), a.shuffle_index.tolist().index(j + 1)
        assert a[ja]["labels"][-1] == a[jb]["tokens"][0]


def test_masks_and_position_resets(tmp_path):
    prefix = str(tmp_path / "ds")
    _write_dataset(prefix, 40, seed=2)
    cfg = _config(tmp_path, ([prefix], None), reset_position_ids=True, reset_attention_mask=True,
                  eod_mask_loss=True)
    train = BlendedMegatronDatasetBuilder(GPTDataset, [50, 5, 5], lambda: True, cfg).build()[0]
    for i in range(10):
        s = train[i]
        eods = (s["tokens"] == EOD).nonzero().flatten().tolist()
        assert (s["loss_mask"][s["tokens"] == EOD] == 0).all()
        expected_pos, start = [], 0
        for p in range(16):
            expected_pos.append(p - start)
            if p in eods:
                start = p + 1
        assert s["position_ids"].tolist() == expected_pos
        mask = s["attention_mask"][0]
        for e in eods:
            assert mask[e + 1:, :e + 1].all()  # True = masked: no attention across the document end
        assert mask.shape == (16, 16) and mask.dtype == numpy.bool_ or str(mask.dtype) == "torch.bool"


def test_weighted_blend_within_one_percent(tmp_path):
    prefixes = []
    for k in range(3):
        prefixes.append(str(tmp_path / f"ds{k}"))
        _write_dataset(prefixes[-1], 200, seed=10 + k)
    blend = get_blend_from_list(["0.5", prefixes[0], "0.3", prefixes[1], "0.2", prefixes[2]])
    cfg = _config(tmp_path, blend, split="100,0,0")
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [100000, None, None], lambda: True, cfg).build()
    assert isinstance(train, BlendedDataset) and valid is None and test is None
    assert len(train) == 100000
    share = numpy.bincount(train.dataset_index, minlength=3) / len(train)
    numpy.testing.assert_allclose(share, [0.5, 0.3, 0.2], atol=0.01)
    assert int(train[5]["dataset_id"]) == int(train.dataset_index[5])


def test_unweighted_blend_and_split_parsing(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _write_dataset(a, 30, seed=3)
    _write_dataset(b, 30, seed=4)
    assert get_blend_from_list([a, b]) == ([a, b], None)
    train = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True,
                                          _config(tmp_path, ([a, b], None))).build()[0]
    assert len(train) == sum(len(d) for d in train.datasets)  # exhaustive: every sample once
    assert parse_and_normalize_split("99,1") == [0.99, 0.01, 0.0]
    assert convert_split_vector_to_split_matrix([0.5, 0.0, 0.5]) == [(0, 0.5), None, (0.5, 1.0)]


def test_mock_dataset_quick_start():
    cfg = GPTDatasetConfig(random_seed=0, sequence_length=64, reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, tokenizer=_NullTokenizer(vocab_size=64))
    train, valid, test = BlendedMegatronDatasetBuilder(MockGPTDataset, [1000, None, None], lambda: True, cfg).build()
    s = train[0]
    assert set(s) == {"tokens", "labels", "loss_mask", "attention_mask", "position_ids"}
    assert s["tokens"].shape == (64,) and int(s["tokens"].max()) < 64
    assert len(valid) > 0 and len(test) > 0


def test_document_offsets():
    eod = 9
    tokens = torch.tensor([1, 2, eod, 3, eod, eod, 4, 5])
    assert _document_offsets(tokens, eod).tolist() == [0, 3, 5, 6, 8, 8, 8, 8, 8]
    assert _document_offsets(torch.tensor([1, 2, 3, eod]), eod).tolist() == [0, 4, 4, 4, 4]

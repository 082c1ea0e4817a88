"""`.bin/.idx` round trips and byte-exact layout (COMPAT.md 4.1)."""
import struct

import numpy
import pytest

from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder


def _hand_built_idx(dtype_code, lengths, itemsize, doc_idx):
    """The `.idx` bytes Megatron writes, assembled by hand from the layout table."""
    pointers = numpy.concatenate([[0], numpy.cumsum(lengths)[:-1]]) * itemsize
    return (b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, dtype_code, len(lengths), len(doc_idx))
            + struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(lengths)}q", *pointers)
            + struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def test_golden_idx_bytes(tmp_path):
    prefix = str(tmp_path / "golden")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    builder.add_item([1, 2, 3])
    builder.end_document()
    builder.add_document([4, 5, 6, 7, 8], lengths=[2, 3])
    builder.finalize(prefix + ".idx")
    want = _hand_built_idx(8, [3, 2, 3], 2, [0, 1, 3])
    assert open(prefix + ".idx", "rb").read() == want
    assert open(prefix + ".bin", "rb").read() == numpy.arange(1, 9, dtype="<u2").tobytes()
    # literal bytes of the header: magic, version 1, dtype 8 (uint16), 3 sequences, 3 document entries
    assert want[:34].hex() == ("4d4d4944494458000001000000000000000803000000000000000300000000000000")


@pytest.mark.parametrize("dtype_code,dtype", [(8, numpy.uint16), (4, numpy.int32), (5, numpy.int64)])
def test_reader_on_hand_built_files(tmp_path, dtype_code, dtype):
    """A pair written byte by byte (as Megatron's builder would) reads back through our reader."""
    lengths, doc_idx = [4, 1, 6, 2], [0, 2, 3, 4]
    tokens = numpy.arange(100, 113, dtype=dtype)
    prefix = str(tmp_path / "hand")
    open(prefix + ".idx", "wb").write(_hand_built_idx(dtype_code, lengths, numpy.dtype(dtype).itemsize, doc_idx))
    open(prefix + ".bin", "wb").write(tokens.astype(numpy.dtype(dtype).newbyteorder("<")).tobytes())
    for mmap in (True, False):
        ds = IndexedDataset(prefix, mmap=mmap)
        assert len(ds) == 4 and ds.index.dtype == dtype
        numpy.testing.assert_array_equal(ds.sequence_lengths, lengths)
        numpy.testing.assert_array_equal(ds.document_indices, doc_idx)
        numpy.testing.assert_array_equal(ds[2], tokens[5:11])
        numpy.testing.assert_array_equal(ds.get(2, offset=1, length=3), tokens[6:9])
        numpy.testing.assert_array_equal(ds.get(0, offset=2), tokens[2:4])
        numpy.testing.assert_array_equal(numpy.concatenate(ds[1:4]), tokens[4:13])


def test_round_trip_and_merge(tmp_path):
    rng = numpy.random.default_rng(0)
    docs = [[rng.integers(0, 70000, size=rng.integers(0, 20)) for _ in range(rng.integers(1, 4))]
            for _ in range(30)]
    dtype = DType.optimal_dtype(70000)
    assert dtype == numpy.int32 and DType.optimal_dtype(50000) == numpy.uint16
    prefixes = []
    for part in range(2):
        prefix = str(tmp_path / f"part{part}")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for doc in docs[part * 15:(part + 1) * 15]:
            for sentence in doc:
                builder.add_item(sentence)
            builder.end_document()
        builder.finalize(prefix + ".idx")
        prefixes.append(prefix)
    merged = str(tmp_path / "merged")
    builder = IndexedDatasetBuilder(merged + ".bin", dtype=dtype)
    for prefix in prefixes:
        builder.add_index(prefix)
    builder.finalize(merged + ".idx")
    ds = IndexedDataset(merged)
    flat = [s for doc in docs for s in doc]
    assert len(ds) == len(flat)
    for got, want in zip((ds[i] for i in range(len(ds))), flat):
        numpy.testing.assert_array_equal(got, want)
    numpy.testing.assert_array_equal(ds.document_indices,
                                     numpy.concatenate([[0], numpy.cumsum([len(d) for d in docs])]))


def test_bad_magic_is_a_clear_error(tmp_path):
    prefix = str(tmp_path / "bad")
    open(prefix + ".idx", "wb").write(b"TNTIDX\x00\x00" + bytes(40))
    open(prefix + ".bin", "wb").write(b"")
    with pytest.raises(ValueError, match="MMIDIDX"):
        IndexedDataset(prefix)
    with pytest.raises(ValueError, match="missing file"):
        IndexedDataset(str(tmp_path / "nope"))

"""Memory-mapped `.bin/.idx` token datasets, byte-compatible with Megatron-LM (COMPAT.md 4.1).

`.idx` layout (little-endian): magic, uint64 version 1, uint8 dtype code, uint64 sequence count N,
uint64 document count D, int32 lengths[N], int64 byte pointers[N], int64 document indices[D]
and, for multimodal data only, int8 modes[N]. `.bin` is the raw concatenation of every sequence.
"""
import os
import shutil
import struct
from enum import Enum
from typing import List, Optional, Sequence, Tuple, Type, Union

import numpy

from megatron.core.errors import InputError

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_VERSION = 1


class DType(Enum):
    """Token dtype codes stored in the `.idx` header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: Type[numpy.number]) -> int:
        return cls[numpy.dtype(value).name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> Type[numpy.number]:
        return getattr(numpy, cls(value).name)

    @staticmethod
    def size(key: Union[int, Type[numpy.number]]) -> int:
        if isinstance(key, int):
            return numpy.dtype(DType.dtype_from_code(key)).itemsize
        return numpy.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> Type[numpy.number]:
        """uint16 when every token id fits (Megatron's 65 500 cut-off), else int32."""
        if cardinality is not None and cardinality < 65500:
            return numpy.uint16
        return numpy.int32


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def _write_index(idx_path, dtype, sequence_lengths, document_indices, sequence_modes=None):
    lengths = numpy.asarray(sequence_lengths, dtype=numpy.int32)
    itemsize = DType.size(dtype)
    pointers = numpy.zeros(len(lengths), dtype=numpy.int64)
    if len(lengths) > 1:
        numpy.cumsum(lengths[:-1].astype(numpy.int64) * itemsize, out=pointers[1:])
    with open(idx_path, "wb") as f:
        f.write(_INDEX_HEADER)
        f.write(struct.pack("<Q", _VERSION))
        f.write(struct.pack("<B", DType.code_from_dtype(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(lengths.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(numpy.asarray(document_indices, dtype="<i8").tobytes(order="C"))
        if sequence_modes is not None:
            f.write(numpy.asarray(sequence_modes, dtype=numpy.int8).tobytes(order="C"))


class _IndexReader:
    """Parses an `.idx` file into memory-mapped numpy views."""

    def __init__(self, idx_path: str, multimodal: bool):
        with open(idx_path, "rb") as f:
            header = f.read(9)
            if header != _INDEX_HEADER:
                raise ValueError(f"{idx_path}: not a Megatron MMIDIDX index (bad magic {header!r})")
            version = struct.unpack("<Q", f.read(8))[0]
            if version != _VERSION:
                raise ValueError(f"{idx_path}: unsupported index version {version}, expected 1")
            self.dtype = DType.dtype_from_code(struct.unpack("<B", f.read(1))[0])
            self.dtype_size = DType.size(self.dtype)
            self.sequence_count = struct.unpack("<Q", f.read(8))[0]
            self.document_count = struct.unpack("<Q", f.read(8))[0]
            offset = f.tell()
        self._mmap = numpy.memmap(idx_path, mode="r", order="C")
        n, d = self.sequence_count, self.document_count
        self.sequence_lengths = numpy.frombuffer(self._mmap, dtype=numpy.int32, count=n, offset=offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = numpy.frombuffer(self._mmap, dtype=numpy.int64, count=n, offset=offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = numpy.frombuffer(self._mmap, dtype=numpy.int64, count=d, offset=offset)
        offset += self.document_indices.nbytes
        self.sequence_modes = None
        if multimodal:
            self.sequence_modes = numpy.frombuffer(self._mmap, dtype=numpy.int8, count=n, offset=offset)
        if d == 0 or self.document_indices[-1] != n:
            raise ValueError(f"{idx_path}: corrupt index, last document index != sequence count {n}")

    def __len__(self) -> int:
        return self.sequence_count

    def __getitem__(self, idx: int) -> Tuple[numpy.int64, numpy.int32, Optional[numpy.int8]]:
        mode = self.sequence_modes[idx] if self.sequence_modes is not None else None
        return self.sequence_pointers[idx], self.sequence_lengths[idx], mode


def check_dataset_files(path_prefix: str, multimodal: bool = False) -> None:
    """Raise InputError (one line naming the file and the sizes) unless `<prefix>.idx` is a complete index
    and `<prefix>.bin` holds every byte it points to. Reads the header and two entries, not the arrays."""
    idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise InputError(f"missing file {path}; expected a <prefix>.bin/.idx pair written by "
                             "tools/preprocess_data.py")
        if not os.access(path, os.R_OK):
            raise InputError(f"{path} is not readable (permissions)")
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(34)
        if len(head) < 34 or head[:9] != _INDEX_HEADER:
            raise InputError(f"{idx_path} is not a Megatron MMIDIDX index ({idx_size} bytes, bad header); "
                             "re-run tools/preprocess_data.py")
        code, n, d = struct.unpack("<B", head[17:18])[0], *struct.unpack("<QQ", head[18:34])
        if code not in {t.value for t in DType}:
            raise InputError(f"{idx_path}: unknown token dtype code {code}; re-run tools/preprocess_data.py")
        expected_idx = 34 + n * (4 + 8) + d * 8 + (n if multimodal else 0)
        if idx_size < expected_idx:
            raise InputError(f"{idx_path} is truncated: {idx_size} bytes, its header ({n} sequences, {d} documents) "
                             f"needs {expected_idx}; re-run tools/preprocess_data.py")
        expected_bin = 0
        if n > 0:
            f.seek(34 + (n - 1) * 4)
            last_length = struct.unpack("<i", f.read(4))[0]
            f.seek(34 + n * 4 + (n - 1) * 8)
            last_pointer = struct.unpack("<q", f.read(8))[0]
            expected_bin = last_pointer + last_length * DType.size(code)
    bin_size = os.path.getsize(bin_path)
    if bin_size < expected_bin:
        raise InputError(f"{bin_path} is truncated: {bin_size} bytes, but {idx_path} indexes {expected_bin} "
                         "bytes; copy it again or re-run tools/preprocess_data.py")


class IndexedDataset:
    """Reader for a `<prefix>.bin/.idx` pair; item i is sequence i as a numpy array.

    Args:
        path_prefix: path without the `.bin/.idx` suffix.
        multimodal: whether the index carries per-sequence modes.
        mmap: memory-map the `.bin` (True) or read it with file reads (False).
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True, object_storage_config=None,
                 s3_config=None, fast_cache_load: bool = False, sequences_per_dataset=None, dtype_code=None):
        if object_storage_config is not None or s3_config is not None or fast_cache_load:
            raise NotImplementedError("IndexedDataset: object-storage / S3 / fast-cache loading is not supported; "
                                      "read the .bin/.idx pair from a local path")
        if sequences_per_dataset is not None or dtype_code is not None:
            raise NotImplementedError("IndexedDataset(sequences_per_dataset/dtype_code) (index reads without the "
                                      ".idx header) is not supported; the .idx file is always read")
        check_dataset_files(path_prefix, multimodal)
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self.index = _IndexReader(get_idx_path(path_prefix), multimodal)
        bin_path = get_bin_path(path_prefix)
        if mmap and os.path.getsize(bin_path) > 0:
            self._bin = numpy.memmap(bin_path, mode="r", order="C")
        else:
            self._bin = None

    def __getstate__(self):
        return self.path_prefix, self.multimodal, self.mmap

    def __setstate__(self, state):
        self.__init__(*state)

    def __len__(self) -> int:
        return len(self.index)

    def _read(self, pointer: int, count: int) -> numpy.ndarray:
        dtype = self.index.dtype
        if self._bin is not None:
            return numpy.frombuffer(self._bin, dtype=dtype, count=count, offset=int(pointer))
        with open(get_bin_path(self.path_prefix), "rb") as f:
            f.seek(int(pointer))
            return numpy.frombuffer(f.read(count * DType.size(dtype)), dtype=dtype, count=count)

    def __getitem__(self, idx: Union[int, numpy.integer, slice]):
        if isinstance(idx, (int, numpy.integer)):
            pointer, length, mode = self.index[idx]
            seq = self._read(pointer, int(length))
            return (seq, mode) if mode is not None else seq
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices into an IndexedDataset must be contiguous: {idx}")
            lengths = self.index.sequence_lengths[start:stop]
            if len(lengths) == 0:
                return []
            flat = self._read(self.index.sequence_pointers[start], int(numpy.sum(lengths)))
            seqs = numpy.split(flat, numpy.cumsum(lengths)[:-1])
            if self.index.sequence_modes is not None:
                return seqs, self.index.sequence_modes[start:stop]
            return seqs
        raise TypeError(f"unexpected index type {type(idx)}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        """Read `length` tokens of sequence `idx` starting at token `offset` (to the end if None)."""
        pointer, size, mode = self.index[idx]
        if length is None:
            length = int(size) - offset
        seq = self._read(int(pointer) + offset * self.index.dtype_size, int(length))
        return (seq, mode) if mode is not None else seq

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> numpy.ndarray:
        return self.index.document_indices

    @property
    def sequence_modes(self) -> Optional[numpy.ndarray]:
        return self.index.sequence_modes

    def get_document_indices(self) -> numpy.ndarray:
        return self.index.document_indices

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.exists(get_idx_path(path_prefix)) and os.path.exists(get_bin_path(path_prefix))


class IndexedDatasetBuilder:
    """Streams sequences into `<prefix>.bin` and writes the `.idx` on `finalize`.

    Memory holds only the per-sequence lengths and document boundaries, never the tokens.
    """

    def __init__(self, bin_path: str, dtype: Type[numpy.number] = numpy.int32, multimodal: bool = False):
        self.data_file = open(bin_path, "wb")
        self.dtype = dtype
        self.multimodal = multimodal
        self.sequence_lengths: List[int] = []
        self.document_indices: List[int] = [0]
        self.sequence_modes: Optional[List[int]] = [] if multimodal else None

    def add_item(self, tensor, mode: int = 0) -> None:
        """Append one sequence (a torch tensor, numpy array or list of token ids)."""
        if hasattr(tensor, "numpy"):
            tensor = tensor.numpy()
        arr = numpy.asarray(tensor, dtype=self.dtype)
        self.data_file.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(arr.size)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def add_document(self, tensor, lengths: Sequence[int], modes: Optional[Sequence[int]] = None) -> None:
        """Append a document whose sequences (e.g. sentences) have the given lengths."""
        if hasattr(tensor, "numpy"):
            tensor = tensor.numpy()
        arr = numpy.asarray(tensor, dtype=self.dtype)
        self.data_file.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(int(x) for x in lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.multimodal:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every sequence and document of another `.bin/.idx` pair (merging)."""
        index = _IndexReader(get_idx_path(path_prefix), multimodal=self.multimodal)
        if index.dtype != self.dtype:
            raise ValueError(f"{path_prefix}: dtype {index.dtype.__name__} differs from the builder's "
                             f"{numpy.dtype(self.dtype).name}; merge only datasets of one dtype")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(index.sequence_lengths.tolist())
        self.document_indices.extend((index.document_indices[1:] + offset).tolist())
        if self.multimodal:
            self.sequence_modes.extend(index.sequence_modes.tolist())
        with open(get_bin_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self.data_file, length=1 << 24)

    def finalize(self, idx_path: str) -> None:
        self.data_file.close()
        _write_index(idx_path, self.dtype, self.sequence_lengths, self.document_indices, self.sequence_modes)

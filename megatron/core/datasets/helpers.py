"""Python entry points to the C++ index helpers, compiling them on first use from a source tree."""
import importlib

import numpy

from megatron.core.datasets.utils import ensure_helpers_built

_module = None


def _helpers_cpp():
    global _module
    if _module is None:
        try:
            _module = importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError:
            ensure_helpers_built()
            importlib.invalidate_caches()
            _module = importlib.import_module("megatron.core.datasets.helpers_cpp")
    return _module


def build_sample_idx(sizes: numpy.ndarray, document_indices: numpy.ndarray, sequence_length: int,
                     num_epochs: int, tokens_per_epoch: int, drop_last_partial_sequence: bool = True,
                     add_extra_token_to_sequence: bool = True) -> numpy.ndarray:
    """GPT sample index [num_samples + 1, 2]; int32 unless positions or offsets could overflow it."""
    sample_idx_max = max(document_indices.shape[0], int(sizes.max()) if len(sizes) else 0)
    fn = "build_sample_idx_int32" if sample_idx_max <= numpy.iinfo(numpy.int32).max else "build_sample_idx_int64"
    return getattr(_helpers_cpp(), fn)(sizes, document_indices, sequence_length, num_epochs, tokens_per_epoch,
                                       drop_last_partial_sequence, int(add_extra_token_to_sequence))


def build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets, size, verbose):
    _helpers_cpp().build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets, size, verbose)


def build_exhaustive_blending_indices(dataset_index, dataset_sample_index, sizes, num_datasets):
    _helpers_cpp().build_exhaustive_blending_indices(dataset_index, dataset_sample_index, sizes, num_datasets)


def build_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed, verbose,
                  min_num_sent):
    return _helpers_cpp().build_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length,
                                        short_seq_prob, seed, verbose, min_num_sent)

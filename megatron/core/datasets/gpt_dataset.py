"""GPT pretraining samples: fixed-length token windows over shuffled documents (COMPAT.md 4.4).

The document, sample and shuffle indices are built exactly as Megatron-LM builds them (same
RandomState call sequence), so a data prefix, seed, length, split and sample count give the same
samples in the same order as Megatron-LM.
"""
import logging
import os
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy
import torch

from megatron.core._compat_fields import check_compat_fields
from megatron.core.datasets import helpers
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, log_single_rank

logger = logging.getLogger(__name__)

_PAD_TOKEN_ID = -1


@dataclass
class GPTDatasetConfigCompat:
    """GPTDatasetConfig fields of Megatron Core 0.19.2 without a counterpart here (context-parallel-aware
    packing, document masking, object storage), at Megatron's defaults: refused elsewhere."""

    context_parallel_size: Optional[int] = None
    data_parallel_size: int = 1
    sequence_parallel_size: int = 0
    hybrid_context_parallel: bool = False
    inter_document_masking: bool = False
    object_storage_cache_path: Optional[str] = None
    sequences_per_dataset: Optional[dict] = None


@dataclass
class GPTDatasetConfig(GPTDatasetConfigCompat, BlendedMegatronDatasetConfig):
    reset_position_ids: Optional[bool] = None
    reset_attention_mask: Optional[bool] = None
    eod_mask_loss: Optional[bool] = None
    create_attention_mask: bool = True
    drop_last_partial_validation_sequence: bool = True
    add_extra_token_to_sequence: bool = True

    def __post_init__(self):
        super().__post_init__()
        check_compat_fields(self, GPTDatasetConfigCompat)
        if self.tokenizer is None:
            raise ValueError("GPTDatasetConfig needs a tokenizer (for its eod and pad ids)")
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(self, name) is None:
                raise ValueError(f"GPTDatasetConfig.{name} must be set (True or False)")


class GPTDataset(MegatronDataset):
    """Samples of `sequence_length` tokens (+1 extra for the shifted labels) from an IndexedDataset."""

    def __init__(self, indexed_dataset, dataset_path: Optional[str], indexed_indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: GPTDatasetConfig):
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.masks_and_position_ids_are_cacheable = not any(
            [config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss])
        self.masks_and_position_ids_are_cached = False
        self.cached_attention_mask = None
        self.cached_loss_mask = None
        self.cached_position_ids = None
        try:
            self._pad_token_id = config.tokenizer.pad
        except Exception:
            self._pad_token_id = _PAD_TOKEN_ID
        if self._pad_token_id is None or self._pad_token_id == config.tokenizer.eod:
            self._pad_token_id = _PAD_TOKEN_ID
        self.document_index, self.sample_index, self.shuffle_index = self._build_document_sample_shuffle_indices()

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        return low_level_dataset.sequence_lengths.shape[0]

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        text, _ = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        text = torch.from_numpy(text).long()
        if self.config.add_extra_token_to_sequence:
            tokens = text[:-1].contiguous()
            labels = text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad_token_id

        if not self.masks_and_position_ids_are_cacheable or not self.masks_and_position_ids_are_cached:
            attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
                tokens, self.config.tokenizer.eod, self.config.reset_position_ids,
                self.config.reset_attention_mask, self.config.eod_mask_loss, self.config.create_attention_mask)
            if self.masks_and_position_ids_are_cacheable:
                self.cached_attention_mask = attention_mask
                self.cached_loss_mask = loss_mask
                self.cached_position_ids = position_ids
                self.masks_and_position_ids_are_cached = True
        else:
            attention_mask = self.cached_attention_mask
            loss_mask = self.cached_loss_mask
            position_ids = self.cached_position_ids

        # pads are loss-masked and mapped to a valid embedding row
        loss_mask = loss_mask.clone()
        loss_mask[labels == self._pad_token_id] = 0.0
        tokens[tokens == self._pad_token_id] = 0
        labels[labels == self._pad_token_id] = 0
        if idx is None:  # a padding sample for an incomplete batch: contributes no loss
            loss_mask = torch.zeros_like(loss_mask)

        sample = {"tokens": tokens, "labels": labels}
        if self.config.create_attention_mask:
            sample["attention_mask"] = attention_mask
        elif self.config.reset_attention_mask:
            sample["cu_seqlens"] = _document_offsets(tokens, self.config.tokenizer.eod)
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _query_document_sample_shuffle_indices(self, idx: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """Tokens of sample `idx` (after shuffling), padded to the sample length, and its document ids."""
        text, document_ids = self._sample_text(idx)
        target = self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        if len(text) < target:  # a partial last validation sample (drop_last_partial_validation_sequence off)
            text = numpy.concatenate([text, numpy.full(target - len(text), self._pad_token_id, dtype=numpy.int64)])
        return text, document_ids

    def _sample_text(self, idx: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """The tokens sample `idx` reads from its documents (unpadded, int64) and the documents' ids: the
        hook a subclass rewrites samples in (GPTFIMDataset permutes them into fill-in-the-middle order)."""
        idx = self.shuffle_index[idx]
        extra = int(self.config.add_extra_token_to_sequence)
        doc_beg, offset_beg = self.sample_index[idx]
        doc_end, offset_end = self.sample_index[idx + 1]
        document_ids, parts = [], []
        if doc_beg == doc_end:
            document_ids.append(self.document_index[doc_beg])
            parts.append(self.dataset.get(self.document_index[doc_beg], offset=int(offset_beg),
                                          length=int(offset_end - offset_beg) + extra))
        else:
            for i in range(doc_beg, doc_end + 1):
                document_ids.append(self.document_index[i])
                offset = 0 if i > doc_beg else int(offset_beg)
                length = None if i < doc_end else int(offset_end) + extra
                parts.append(self.dataset.get(self.document_index[i], offset=offset, length=length))
        return numpy.concatenate(parts, dtype=numpy.int64), numpy.array(document_ids, dtype=numpy.int64)

    def _cache_paths(self) -> Optional[Dict[str, str]]:
        path_to_cache = self.config.path_to_cache
        if path_to_cache is None and not self.config.mock:
            path_to_cache = os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")
        if not path_to_cache:
            return None
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        return {affix: os.path.join(path_to_cache, f"{base}-{affix}")
                for affix in ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy")}

    def _build_document_sample_shuffle_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        """Build (rank 0, or every rank without a cache) and save, or load the cached indices."""
        paths = self._cache_paths()
        cache_hit = paths is not None and all(os.path.isfile(p) for p in paths.values())
        is_rank_0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if paths is None or (not cache_hit and is_rank_0):
            return self._build_and_save(paths)
        log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} {self.index_split.name} indices")
        if not cache_hit:
            raise RuntimeError(f"{type(self).__name__} index cache missing on this rank: {paths['description.txt']}; "
                               "with several nodes set --data-cache-path to a directory every node can read")
        load = lambda key: numpy.load(paths[key], allow_pickle=True, mmap_mode="r")
        return load("document_index.npy"), load("sample_index.npy"), load("shuffle_index.npy")

    def _build_and_save(self, paths):
        log_single_rank(logger, logging.INFO,
                        f"Build and save the {type(self).__name__} {self.index_split.name} indices")
        self.built_anew_on_cache_miss = True
        t_beg = time.time()
        document_index, sample_index, shuffle_index = self._build_indices()
        log_single_rank(logger, logging.DEBUG, f"\t> time elapsed: {time.time() - t_beg:4f} seconds")
        if paths is not None:
            os.makedirs(os.path.dirname(paths["description.txt"]), exist_ok=True)
            with open(paths["description.txt"], "wt") as writer:
                writer.write(self.unique_description)
            for key, array in (("document_index.npy", document_index), ("sample_index.npy", sample_index),
                               ("shuffle_index.npy", shuffle_index)):
                numpy.save(paths[key], array, allow_pickle=True)
        log_single_rank(logger, logging.INFO, f"> total number of samples: {sample_index.shape[0] - 1}")
        log_single_rank(logger, logging.INFO, f"> total number of epochs: {self._num_epochs}")
        return document_index, sample_index, shuffle_index

    def _build_indices(self):
        sequence_length = self.config.sequence_length
        extra = int(self.config.add_extra_token_to_sequence)
        num_tokens_per_epoch = int(numpy.sum(self.dataset.sequence_lengths[self.indices]))
        num_epochs = self._get_num_epochs(num_tokens_per_epoch)
        self._num_epochs = num_epochs
        separate_final_epoch = False
        if num_epochs > 1:
            # samples from the last epoch; shuffled separately if it is under 80% of an epoch
            num_samples_sans_final_epoch = ((num_epochs - 1) * num_tokens_per_epoch - extra) // sequence_length
            num_samples_from_final_epoch = self.num_samples - num_samples_sans_final_epoch
            num_samples_per_epoch = (num_tokens_per_epoch - extra) // sequence_length
            assert 0 <= num_samples_from_final_epoch <= num_samples_per_epoch + 1
            separate_final_epoch = num_samples_from_final_epoch < int(0.80 * num_samples_per_epoch)

        numpy_random_state = numpy.random.RandomState(self.config.random_seed)
        document_index = _build_document_index(self.indices, num_epochs, numpy_random_state, separate_final_epoch)

        drop_last = True
        if self.index_split == Split.valid:
            drop_last = self.config.drop_last_partial_validation_sequence
        sequence_lengths = self.dataset.sequence_lengths
        if len(document_index) * 2 > len(sequence_lengths):
            sequence_lengths = numpy.array(sequence_lengths)  # dense access: read the mmap once
        sample_index = helpers.build_sample_idx(numpy.asarray(sequence_lengths, dtype=numpy.int32), document_index,
                                                sequence_length, num_epochs, num_tokens_per_epoch, drop_last, extra)
        num_samples = sample_index.shape[0] - 1
        if separate_final_epoch:
            shuffle_index = _build_shuffle_index(num_samples_sans_final_epoch, num_samples, numpy_random_state)
        else:
            shuffle_index = _build_shuffle_index(num_samples, num_samples, numpy_random_state)
        return document_index, sample_index, shuffle_index

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        """Smallest epoch count whose tokens cover num_samples windows plus the extra token."""
        if self.num_samples is None:
            return 1
        if num_tokens_per_epoch <= 0:
            raise ValueError(f"{type(self).__name__} {self.index_split.name} split has no tokens; "
                             "check --split and the data prefix")
        requested = self.num_samples * self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        num_epochs, num_tokens = 1, num_tokens_per_epoch
        while num_tokens < requested:
            num_epochs += 1
            num_tokens += num_tokens_per_epoch
        return num_epochs


def _build_document_index(documents: numpy.ndarray, num_epochs: int, numpy_random_state: numpy.random.RandomState,
                          separate_final_epoch: bool) -> numpy.ndarray:
    """The split's document ids repeated per epoch and shuffled (final epoch apart if separated)."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = numpy.tile(numpy.asarray(documents), num_epochs).astype(numpy.int32)
        numpy_random_state.shuffle(document_index)
        return document_index
    first = _build_document_index(documents, num_epochs - 1, numpy_random_state, False)
    last = _build_document_index(documents, 1, numpy_random_state, False)
    return numpy.concatenate((first, last))


def _build_shuffle_index(num_samples: int, total_size: int, numpy_random_state: numpy.random.RandomState
                         ) -> numpy.ndarray:
    """Permutation of [0, total_size): [0, num_samples) and [num_samples, total_size) shuffled apart."""
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    first = numpy.arange(0, num_samples, dtype=dtype)
    numpy_random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    numpy_random_state.shuffle(last)
    return numpy.concatenate((first, last))


def _get_ltor_masks_and_position_ids(data: torch.Tensor, eod_token: int, reset_position_ids: bool,
                                     reset_attention_mask: bool, eod_mask_loss: bool, create_attention_mask: bool):
    """Causal mask [1, s, s] (True = masked), loss mask [s] and position ids [s] for one sample."""
    seq_length = data.numel()
    attention_mask = None
    if create_attention_mask:
        attention_mask = torch.tril(torch.ones((seq_length, seq_length), device=data.device)).unsqueeze(0)
    loss_mask = torch.ones(seq_length, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    if reset_position_ids or reset_attention_mask:
        eod_index = position_ids[data == eod_token].clone()
        prev_index = 0
        for i in eod_index.tolist():
            if reset_attention_mask and attention_mask is not None:
                attention_mask[0, (i + 1):, :(i + 1)] = 0
            if reset_position_ids:
                position_ids[(i + 1):] -= i + 1 - prev_index
                prev_index = i + 1
    if attention_mask is not None:
        attention_mask = attention_mask < 0.5
    return attention_mask, loss_mask, position_ids


def _document_offsets(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """Document start offsets of one sample plus its end, [s + 1] int32: a document ends after each EOD.
    Padded to a fixed length with the end offset (empty documents) so samples collate into a batch."""
    seq_length = tokens.numel()
    starts = (tokens == eod_token).nonzero().flatten() + 1
    starts = starts[starts < seq_length]
    cu = torch.full((seq_length + 1,), seq_length, dtype=torch.int32)
    cu[0] = 0
    cu[1:1 + starts.numel()] = starts.to(torch.int32)
    return cu


class MockGPTLowLevelDataset:
    """100 000 synthetic documents; document i is (1 .. len-1) mod vocab followed by EOD."""

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        rng = numpy.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size,
                                             dtype=numpy.int32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> numpy.ndarray:
        length = int(self.sequence_lengths[idx])
        body = numpy.arange(1, length, dtype=numpy.int64) % self.tokenizer.vocab_size
        return numpy.concatenate([body, [self.tokenizer.eod]]).astype(numpy.int64)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset:offset + length]


class MockGPTDataset(GPTDataset):
    """GPTDataset over MockGPTLowLevelDataset (`--mock-data`); indices cached only with a cache path."""

    def __init__(self, dataset, dataset_path, indices, num_samples, index_split, config):
        if not config.mock:
            raise ValueError("MockGPTDataset needs a config without a data blend (mock data)")
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        return MockGPTLowLevelDataset(config.tokenizer)

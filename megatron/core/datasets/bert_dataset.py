"""BERT pretraining samples: [CLS] A [SEP] B [SEP] with masked-LM targets and the sentence-order label
(COMPAT.md 4.7)."""
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.masked_dataset import (
    MaskedWordPieceDataset,
    MaskedWordPieceDatasetConfig,
    MockMaskedLowLevelDataset,
)
from megatron.core.datasets.utils import Split


@dataclass
class BERTMaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    classification_head: Optional[bool] = None
    """Build sentence pairs for the sentence-order (binary) head; off with --bert-no-binary-head."""

    def __post_init__(self):
        super().__post_init__()
        if self.classification_head is None:
            raise ValueError("BERTMaskedWordPieceDatasetConfig.classification_head must be set")
        if self.sequence_length < 4:
            raise ValueError(f"--seq-length {self.sequence_length} is too short for [CLS] A [SEP] B [SEP]")


class BERTMaskedWordPieceDataset(MaskedWordPieceDataset):
    """Keys: text, types, labels (-1 unmasked), is_random, padding_mask, loss_mask, truncated."""

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: str, indexed_indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: BERTMaskedWordPieceDatasetConfig):
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        # 3 slots for [CLS] and the two [SEP]; a pair needs 2 sentences
        self.sample_index = self._build_sample_index(config.sequence_length - 3,
                                                     2 if config.classification_head else 1)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return super(BERTMaskedWordPieceDataset, BERTMaskedWordPieceDataset)._key_config_attributes() + [
            "classification_head"]

    def _get_token_mask(self, rng: numpy.random.RandomState) -> Optional[int]:
        """80% [MASK], 10% a random vocabulary token, 10% unchanged."""
        if rng.random_sample() < 0.8:
            return self.config.tokenizer.mask
        if rng.random_sample() >= 0.5:
            return int(self.token_lookup[rng.randint(0, len(self.token_lookup))])
        return None

    def _segments(self, sample, rng):
        """Split the sentences at a random pivot into A and B; swap them with p=0.5 (is_random)."""
        pivot, is_random = len(sample), False
        if self.config.classification_head:
            assert len(sample) > 1, "build_mapping guarantees two sentences per sample with the binary head"
            pivot = 1 if len(sample) < 3 else int(rng.randint(low=1, high=len(sample)))
            is_random = bool(rng.random_sample() < 0.5)
        seg_a = [int(t) for sentence in sample[:pivot] for t in sentence]
        seg_b = [int(t) for sentence in sample[pivot:] for t in sentence]
        if is_random:
            seg_a, seg_b = seg_b, seg_a
        return seg_a, seg_b, is_random

    @staticmethod
    def _truncate(seg_a, seg_b, target: int, rng) -> bool:
        """Drop tokens from a random end of the longer segment until len(A) + len(B) <= target."""
        truncated = len(seg_a) + len(seg_b) > target
        while len(seg_a) + len(seg_b) > target:
            seg = seg_a if len(seg_a) > len(seg_b) else seg_b
            if rng.random_sample() < 0.5:
                del seg[0]
            else:
                del seg[-1]
        return truncated

    def __getitem__(self, idx: int) -> Dict[str, numpy.ndarray]:
        tok = self.config.tokenizer
        beg, end, target = (int(x) for x in self.sample_index[idx])
        sample = [self.dataset[i] for i in range(beg, end)]
        rng = numpy.random.RandomState(seed=(self.config.random_seed + idx) % 2 ** 32)
        seg_a, seg_b, is_random = self._segments(sample, rng)
        truncated = self._truncate(seg_a, seg_b, target, rng)

        tokens = [tok.cls, *seg_a, tok.sep]
        types = [0] * len(tokens)
        if seg_b:
            tokens += [*seg_b, tok.sep]
            types += [1] * (len(seg_b) + 1)
        tokens, positions, labels, _ = self._create_masked_lm_predictions(tokens, target, rng)

        seq_len, n = self.config.sequence_length, len(tokens)
        pad = seq_len - n
        assert pad >= 0, "build_mapping targets leave room for [CLS] and two [SEP]"
        out_labels = numpy.full(seq_len, -1, dtype=numpy.int64)
        out_labels[positions] = labels
        loss_mask = numpy.zeros(seq_len, dtype=numpy.int64)
        loss_mask[positions] = 1
        return {
            "text": numpy.pad(numpy.array(tokens, dtype=numpy.int64), (0, pad), constant_values=tok.pad),
            "types": numpy.pad(numpy.array(types, dtype=numpy.int64), (0, pad), constant_values=0),
            "labels": out_labels,
            "is_random": int(is_random),
            "padding_mask": numpy.pad(numpy.ones(n, dtype=numpy.int64), (0, pad), constant_values=0),
            "loss_mask": loss_mask,
            "truncated": int(truncated),
        }


class MockBERTMaskedWordPieceDataset(BERTMaskedWordPieceDataset):
    """BERTMaskedWordPieceDataset over synthetic sentences (`--mock-data`): same keys and masking."""

    def __init__(self, dataset, dataset_path, indexed_indices, num_samples, index_split, config):
        if not config.mock:
            raise ValueError("MockBERTMaskedWordPieceDataset needs a config without a data blend (mock data)")
        super().__init__(dataset, dataset_path, indexed_indices, num_samples, index_split, config)

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str],
                                config: BERTMaskedWordPieceDatasetConfig) -> MockMaskedLowLevelDataset:
        return MockMaskedLowLevelDataset(config.tokenizer, config.random_seed)

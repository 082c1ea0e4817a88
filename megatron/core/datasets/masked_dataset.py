"""Shared engine of the BERT and T5 datasets: sentence-packed samples and masked-LM corruption.

Samples are runs of whole sentences inside one document (`build_mapping` in helpers.cpp, cached like
the GPT indices); each sample draws its randomness from RandomState(seed + idx), so a sample's
corruption is the same on every rank, run and DataLoader worker (COMPAT.md 4.7-4.8).
"""
import logging
import os
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy
import torch

from megatron.core.datasets import helpers
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, log_single_rank

logger = logging.getLogger(__name__)


@dataclass
class MaskedWordPieceDatasetConfig(BlendedMegatronDatasetConfig):
    """Masking options (Megatron's names). N-gram length N is drawn with P(N) proportional to 1/N, or
    from Geometric(0.2) clipped to ``masking_max_ngram`` (SpanBERT) with the geometric option."""

    masking_probability: Optional[float] = None
    short_sequence_probability: Optional[float] = None
    masking_max_ngram: Optional[int] = None
    masking_do_full_word: Optional[bool] = None
    masking_do_permutation: Optional[bool] = None
    masking_use_longer_ngrams: Optional[bool] = None
    masking_use_geometric_distribution: Optional[bool] = None

    def __post_init__(self):
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError(f"{type(self).__name__} needs a WordPiece tokenizer (--tokenizer-type BertWordPiece*)")
        for name in ("masking_probability", "short_sequence_probability", "masking_max_ngram",
                     "masking_do_full_word", "masking_do_permutation", "masking_use_longer_ngrams",
                     "masking_use_geometric_distribution"):
            if getattr(self, name) is None:
                raise ValueError(f"{type(self).__name__}.{name} must be set")
        if not 0.0 < self.masking_probability <= 1.0:
            raise ValueError(f"--mask-prob must be in (0, 1], got {self.masking_probability}")
        if not 0.0 <= self.short_sequence_probability <= 1.0:
            raise ValueError(f"--short-seq-prob must be in [0, 1], got {self.short_sequence_probability}")
        if self.masking_max_ngram < 1:
            raise ValueError("masking_max_ngram must be >= 1")
        if self.masking_do_permutation:
            raise NotImplementedError("masking_do_permutation is not supported")
        if self.masking_use_longer_ngrams and self.masking_use_geometric_distribution:
            raise ValueError("masking_use_longer_ngrams and masking_use_geometric_distribution exclude each other")


class MaskedWordPieceDataset(MegatronDataset):
    """Base of BERT/T5 datasets: one split of a sentence-level IndexedDataset, indexed by document."""

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: str, indexed_indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: MaskedWordPieceDatasetConfig):
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        # Replacement tokens for the "random token" branch: every id of the vocabulary.
        self.token_lookup = numpy.array(sorted(config.tokenizer.inv_vocab.keys()), dtype=numpy.int64)
        self._special_ids = self._special_token_ids(config.tokenizer)

    @staticmethod
    def _special_token_ids(tokenizer) -> set:
        ids = set()
        for name in ("cls", "sep"):
            try:
                ids.add(getattr(tokenizer, name))
            except NotImplementedError:
                pass
        return ids

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        return low_level_dataset.document_indices.shape[0] - 1

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: MaskedWordPieceDatasetConfig) -> IndexedDataset:
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return super(MaskedWordPieceDataset, MaskedWordPieceDataset)._key_config_attributes() + [
            "masking_probability", "short_sequence_probability", "masking_max_ngram", "masking_do_full_word",
            "masking_do_permutation", "masking_use_longer_ngrams", "masking_use_geometric_distribution"]

    def __len__(self) -> int:
        return self.sample_index.shape[0]

    # -- sample index ---------------------------------------------------------------------------
    def _build_sample_index(self, sequence_length: int, min_sentences_per_sample: int) -> numpy.ndarray:
        """Rows (first sentence, one past the last sentence, target length); rank 0 builds and caches,
        other ranks load the cache (mock data without --data-cache-path: built in memory on every rank)."""
        if self.config.mock and self.config.path_to_cache is None:
            # mock data has no files to cache beside; every rank builds the same index (seeded)
            return self._build_mapping(sequence_length, min_sentences_per_sample)
        path_to_cache = self.config.path_to_cache or os.path.join(
            self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")
        base = os.path.join(path_to_cache, f"{self.unique_description_hash}-{type(self).__name__}-"
                                           f"{self.index_split.name}")
        path_description, path_index = f"{base}-description.txt", f"{base}-sample_index.npy"
        cache_hit = os.path.isfile(path_description) and os.path.isfile(path_index)
        is_rank_0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if cache_hit:
            log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} {self.index_split.name} indices")
            return numpy.load(path_index, allow_pickle=True, mmap_mode="r")
        if not is_rank_0:
            raise RuntimeError(f"{type(self).__name__} index cache missing on this rank: {path_index}; with several "
                               "nodes set --data-cache-path to a directory every node can read")
        log_single_rank(logger, logging.INFO,
                        f"Build and save the {type(self).__name__} {self.index_split.name} indices")
        self.built_anew_on_cache_miss = True
        t_beg = time.time()
        sample_index = self._build_mapping(sequence_length, min_sentences_per_sample)
        os.makedirs(path_to_cache, exist_ok=True)
        with open(path_description, "wt") as writer:
            writer.write(self.unique_description)
        numpy.save(path_index, sample_index, allow_pickle=True)
        log_single_rank(logger, logging.INFO, f"\t> time elapsed: {time.time() - t_beg:4f} seconds")
        log_single_rank(logger, logging.INFO, f"> total number of samples: {sample_index.shape[0]}")
        return sample_index

    def _build_mapping(self, sequence_length: int, min_sentences_per_sample: int) -> numpy.ndarray:
        if len(self.indices) == 0:
            raise ValueError(f"{type(self).__name__} {self.index_split.name} split has no documents; check --split")
        if self.num_samples is not None:
            num_epochs, num_samples = numpy.iinfo(numpy.int32).max - 1, self.num_samples
        else:
            num_epochs, num_samples = 1, numpy.iinfo(numpy.int64).max - 1
        # document boundaries of this split's documents (+1 for the last one's upper bound)
        docs = self.dataset.document_indices[numpy.append(self.indices, self.indices[-1] + 1)]
        sample_index = helpers.build_mapping(
            numpy.ascontiguousarray(docs, dtype=numpy.int64),
            numpy.ascontiguousarray(self.dataset.sequence_lengths, dtype=numpy.int32), num_epochs, num_samples,
            sequence_length, self.config.short_sequence_probability, self.config.random_seed, False,
            min_sentences_per_sample)
        if sample_index.shape[0] == 0 and self.num_samples != 0:
            raise ValueError(f"{type(self).__name__} {self.index_split.name}: no document has the "
                             f"{min_sentences_per_sample} sentence(s) a sample needs; preprocess with "
                             "--split-sentences (or use --bert-no-binary-head)")
        return sample_index

    # -- masking --------------------------------------------------------------------------------
    def _word_candidates(self, token_ids: List[int]) -> List[List[int]]:
        """Positions grouped into maskable units: whole words (a '##' piece joins the previous unit)
        when masking_do_full_word, else single tokens; [CLS]/[SEP] are never masked."""
        inv_vocab = self.config.tokenizer.inv_vocab
        candidates: List[List[int]] = []
        for i, token_id in enumerate(token_ids):
            if token_id in self._special_ids:
                continue
            continues_word = (self.config.masking_do_full_word and candidates and candidates[-1][-1] == i - 1
                              and inv_vocab.get(int(token_id), "").startswith("##"))
            if continues_word:
                candidates[-1].append(i)
            else:
                candidates.append([i])
        return candidates

    def _draw_ngram_size(self, available: numpy.ndarray, pvals: Optional[numpy.ndarray],
                         rng: numpy.random.RandomState) -> int:
        if self.config.masking_use_geometric_distribution:
            return min(int(rng.geometric(0.2)), self.config.masking_max_ngram)
        p = pvals[:len(available)] / pvals[:len(available)].sum(keepdims=True)
        return int(rng.choice(available, p=p))

    def _create_masked_lm_predictions(self, token_ids: List[int], target_sequence_length: int,
                                      rng: numpy.random.RandomState):
        """Mask whole n-grams of candidate units until ~masking_probability of the tokens are masked.

        Returns (masked token ids, masked positions, original labels, masked spans) where a span is
        (positions, original ids), spans sorted by position.
        """
        c = self.config
        candidates = self._word_candidates(token_ids)
        num_to_mask = min(c.masking_probability * target_sequence_length,
                          max(1, int(round(len(token_ids) * c.masking_probability))))
        ngram_sizes = numpy.arange(1, c.masking_max_ngram + 1, dtype=numpy.int64)
        pvals = None
        if not c.masking_use_geometric_distribution:
            pvals = 1.0 / ngram_sizes  # P(n) proportional to 1/n
            pvals = pvals / pvals.sum(keepdims=True)
            if c.masking_use_longer_ngrams:
                pvals = pvals[::-1]
        # candidate_ngrams[k][n - 1] = the n units starting at unit k
        candidate_ngrams = [[candidates[k:k + n] for n in ngram_sizes] for k in range(len(candidates))]
        rng.shuffle(candidate_ngrams)

        masked = list(token_ids)
        positions_and_labels: List[Tuple[int, int]] = []
        spans = []
        taken = set()
        for ngrams in candidate_ngrams:
            if len(positions_and_labels) >= num_to_mask:
                break
            n = self._draw_ngram_size(ngram_sizes[:len(ngrams)], pvals, rng)
            # shrink n until the n-gram fits in the remaining budget
            indices = None
            while n > 0:
                trial = sum(ngrams[n - 1], [])
                if len(positions_and_labels) + len(trial) <= num_to_mask:
                    indices = trial
                    break
                n -= 1
            if indices is None or any(i in taken for i in indices):
                continue
            for i in indices:
                taken.add(i)
                replacement = self._get_token_mask(rng)
                masked[i] = token_ids[i] if replacement is None else replacement
                positions_and_labels.append((i, token_ids[i]))
            spans.append((indices, [token_ids[i] for i in indices]))
        positions_and_labels.sort(key=lambda x: x[0])
        spans.sort(key=lambda x: x[0][0])
        positions = [p for p, _ in positions_and_labels]
        labels = [l for _, l in positions_and_labels]
        return masked, positions, labels, spans

    def _get_token_mask(self, rng: numpy.random.RandomState) -> Optional[int]:
        """Replacement for one masked token; None keeps the original token."""
        raise NotImplementedError


class MockMaskedLowLevelDataset:
    """A synthetic sentence-split corpus for `--mock-data` (BERT, T5), laid out like an IndexedDataset.

    Documents hold 2-16 sentences of 8-48 tokens; a sentence is a run of consecutive ordinary vocabulary
    ids starting at a Zipf-distributed offset, so a masked token is predictable from its neighbours and
    frequent tokens dominate, as in text, and the masked-LM loss falls. Everything is drawn from ``seed``.
    """

    num_documents: int = 10000

    def __init__(self, tokenizer, seed: int):
        self.path_prefix = None
        self.pool = self._ordinary_token_ids(tokenizer)
        rng = numpy.random.default_rng(seed)
        sentences_per_document = rng.integers(2, 17, size=self.num_documents)
        self.document_indices = numpy.concatenate([[0], numpy.cumsum(sentences_per_document)]).astype(numpy.int64)
        num_sentences = int(self.document_indices[-1])
        self.sequence_lengths = rng.integers(8, 49, size=num_sentences).astype(numpy.int32)
        # sentences start at a word, never inside one (a '##' continuation piece)
        word_starts = numpy.flatnonzero([not tokenizer.inv_vocab[int(i)].startswith("##") for i in self.pool])
        self._starts = word_starts[(rng.zipf(1.5, size=num_sentences) - 1) % len(word_starts)]

    @staticmethod
    def _ordinary_token_ids(tokenizer) -> numpy.ndarray:
        """Vocabulary ids minus the special tokens ([CLS], [SEP], [PAD], [MASK], BOS/EOS, sentinels)."""
        special = set(getattr(tokenizer, "additional_special_tokens_ids", None) or [])
        for name in ("cls", "sep", "pad", "mask", "bos", "eos"):
            try:
                special.add(getattr(tokenizer, name))
            except (NotImplementedError, AttributeError):
                pass
        pool = numpy.array(sorted(i for i in tokenizer.inv_vocab if i not in special), dtype=numpy.int64)
        if len(pool) == 0:
            raise ValueError("--mock-data: the tokenizer's vocabulary has no ordinary tokens to draw text from")
        return pool

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int) -> numpy.ndarray:
        """Sentence ``idx``: its token ids."""
        offsets = self._starts[idx] + numpy.arange(int(self.sequence_lengths[idx]))
        return self.pool[offsets % len(self.pool)]

"""Builds the train/valid/test datasets from a config: splits, blends, per-split blends, mock data."""
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Type

import numpy
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split, log_single_rank, normalize

logger = logging.getLogger(__name__)


def _get_size_per_split_per_dataset(normalized_weights: List[float], target_size_per_split: List[Optional[int]],
                                    surplus: float = 0.0) -> List[List[Optional[int]]]:
    """Samples to build from each dataset for each split: ceil(ceil(size * w) * (1 + surplus))."""
    assert numpy.isclose(sum(normalized_weights), 1.0)
    return [[int(math.ceil(math.ceil(size * w) * (1 + surplus))) if size is not None else None
             for size in target_size_per_split] for w in normalized_weights]


class BlendedMegatronDatasetBuilder:
    """Build `cls` datasets for the three splits.

    Args:
        cls: the MegatronDataset subclass (GPTDataset, MockGPTDataset, ...).
        sizes: requested samples per split [train, valid, test]; None = one full epoch.
        is_built_on_rank: whether this rank holds datasets (rank 0 must).
        config: the dataset config.
    """

    def __init__(self, cls: Type[MegatronDataset], sizes: List[Optional[int]], is_built_on_rank: Callable[[], bool],
                 config: BlendedMegatronDatasetConfig):
        self.cls = cls
        self.sizes = sizes
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        log_single_rank(logger, logging.INFO,
                        f"Building {cls.__name__} splits with sizes={self.sizes} and config={self.config}")
        if not self.config.mock:
            for split in Split:
                if self.config.blend_per_split is not None and any(self.config.blend_per_split):
                    blend = self.config.blend_per_split[split.value]
                elif self.config.split_matrix[split.value] is not None:
                    blend = self.config.blend
                else:
                    continue  # this split is empty: no size needed
                if blend is not None and self.sizes[split.value] is None and blend[1] is not None:
                    raise ValueError(f"{split.name} split: weighted blends need a sample count; "
                                     "pass unweighted prefixes or set the schedule (--train-iters/--eval-iters)")
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
            assert is_built_on_rank(), "rank 0 must build the datasets (it writes the index caches)"

    def build(self) -> List[Optional[torch.utils.data.Dataset]]:
        """[train, valid, test]; with ``multiple_validation_sets`` the valid entry is a list, one dataset per
        validation prefix; with ``full_validation`` the valid size is None (one epoch of each)."""
        datasets = self._build_blended_dataset_splits()
        for dataset in datasets:
            if isinstance(dataset, BlendedDataset) and len(dataset) > 0:
                self._verify_blend(dataset)
        return datasets

    @staticmethod
    def _verify_blend(dataset: BlendedDataset) -> None:
        ids, counts = numpy.unique(dataset.dataset_index, return_counts=True)
        for i, count in zip(ids, counts):
            if len(dataset.datasets[i]) < count:
                raise IndexError(f"The {dataset.split.name} blend oversamples dataset {i} "
                                 f"({type(dataset.datasets[i]).__name__}): {count} samples requested, "
                                 f"{len(dataset.datasets[i])} built; raise --mid-level-dataset-surplus")

    def _build_blended_dataset_splits(self) -> List[Optional[torch.utils.data.Dataset]]:
        if self.config.mock:
            return self._build_megatron_dataset_splits(None, self.config.split_matrix, self.sizes)
        if self.config.blend:
            return self._build_blend(self.config.blend, self.config.split_matrix, self.sizes,
                                     single_prefix_plain=self.config.blend[1] is None)
        datasets: List[Optional[torch.utils.data.Dataset]] = [None] * len(Split)
        for i in range(len(Split)):
            blend = self.config.blend_per_split[i]
            if blend is None:
                continue
            split_spoof: List[Optional[tuple]] = [None] * len(Split)
            split_spoof[i] = (0.0, 1.0)
            sizes_spoof: List[Optional[int]] = [0] * len(Split)
            sizes_spoof[i] = self.sizes[i]
            if self.config.multiple_validation_sets and Split(i) == Split.valid:
                # One dataset per validation prefix, each evaluated on its own (a list in the valid slot).
                datasets[i] = [self._build_megatron_dataset_splits(prefix, split_spoof, sizes_spoof)[i]
                               for prefix in blend[0]]
                continue
            datasets[i] = self._build_blend(blend, split_spoof, sizes_spoof, single_prefix_plain=True)[i]
        return datasets

    def _build_blend(self, blend, split, sizes, single_prefix_plain: bool):
        """One blend over `split`: a plain dataset for a single prefix, else a BlendedDataset per split."""
        prefixes, weights = blend
        if weights is not None:
            weights = normalize(weights)
        if len(prefixes) == 1 and single_prefix_plain:
            return self._build_megatron_dataset_splits(prefixes[0], split, sizes)
        if weights is None:
            sizes_buffer = [[None] * len(Split) for _ in prefixes]  # one epoch of each
        else:
            sizes_target = _get_size_per_split_per_dataset(weights, sizes)
            sizes_buffer = _get_size_per_split_per_dataset(weights, sizes, self.config.mid_level_dataset_surplus)
        per_split = self._build_megatron_datasets_parallel(prefixes, split, sizes_buffer)
        blended: List[Optional[BlendedDataset]] = [None] * len(Split)
        for i in range(len(Split)):
            if split[i] is None:
                continue
            weights_i = weights
            if weights is not None and sizes[i] is not None:
                size_i = sum(list(zip(*sizes_target))[i])
            elif weights is None:
                try:
                    weights_i = [len(d) for d in per_split[i]]
                except TypeError:  # not built on this rank
                    weights_i = [0 for _ in prefixes]
                size_i = min(sizes[i], sum(weights_i)) if sizes[i] is not None else None
            else:
                raise ValueError("a weighted blend needs a requested size for every split it feeds")
            blended[i] = self.build_generic_dataset(BlendedDataset, self.is_built_on_rank, True,
                                                    per_split[i], weights_i, size_i, self.config)
        return blended

    def _build_megatron_datasets_parallel(self, prefixes, split, sizes_per_dataset) -> List[List[Any]]:
        """Mid-level datasets for every prefix: rank 0 first (threaded), then the other ranks."""
        def build_one(i):
            return self._build_megatron_dataset_splits(prefixes[i], split, sizes_per_dataset[i],
                                                       synchronize_ranks=False)

        def build_all():
            threads = max(1, self.config.num_dataset_builder_threads)
            with ThreadPoolExecutor(max_workers=threads) as pool:
                return list(pool.map(build_one, range(len(prefixes))))

        if torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
            results = build_all() if rank == 0 else None
            torch.distributed.barrier()
            if rank != 0:
                results = build_all()
        else:
            results = build_all()
        return [[r[j] for r in results] for j in range(len(Split))]

    def _build_megatron_dataset_splits(self, dataset_path: Optional[str], split, sizes,
                                       synchronize_ranks: bool = True) -> List[Optional[MegatronDataset]]:
        """Split one low-level dataset by the split matrix and build each split's dataset."""
        if torch.distributed.is_initialized() and not self.is_built_on_rank():
            for i in range(len(Split)):
                if split[i] is not None and synchronize_ranks:
                    torch.distributed.barrier()
            return [None] * len(Split)
        low_level_dataset = self.cls.build_low_level_dataset(dataset_path, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level_dataset)
        datasets: List[Optional[MegatronDataset]] = []
        for i, split_name in enumerate(Split):
            if split[i] is None:
                datasets.append(None)
                continue
            beg = int(round(split[i][0] * float(num_elements)))
            end = int(round(split[i][1] * float(num_elements)))
            indices = numpy.arange(start=beg, stop=end, step=1, dtype=numpy.int32)
            datasets.append(self.build_generic_dataset(self.cls, self.is_built_on_rank, synchronize_ranks,
                                                       low_level_dataset, dataset_path, indices, sizes[i],
                                                       split_name, self.config))
        return datasets

    @staticmethod
    def build_generic_dataset(cls, is_built_on_rank: Callable[[], bool], synchronize_ranks: bool, *args: Any):
        """Build on rank 0 first (it writes caches), barrier, then on the other ranks (they read them)."""
        if not torch.distributed.is_initialized():
            return cls(*args)
        rank = torch.distributed.get_rank()
        dataset = None
        if rank == 0 and is_built_on_rank():
            try:
                dataset = cls(*args)
            except OSError as err:
                raise RuntimeError("Failed to write dataset indices to the cache directory; pass a writable "
                                   "--data-cache-path") from err
        if synchronize_ranks:
            torch.distributed.barrier()
        if rank != 0 and is_built_on_rank():
            dataset = cls(*args)
        return dataset

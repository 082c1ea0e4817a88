"""A weighted mixture of mid-level datasets, indexed by the deterministic greedy blend (COMPAT.md 4.5)."""
import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple, Union

import numpy
import torch

from megatron.core.datasets import helpers
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import log_single_rank, normalize

logger = logging.getLogger(__name__)

_VERBOSE = False


class BlendedDataset(torch.utils.data.Dataset):
    """Sample k comes from datasets[dataset_index[k]] at position dataset_sample_index[k].

    Args:
        weights: blend weights (normalised when `size` is given), or per-dataset sample counts
            when `size` is None (exhaustive blend: every sample of every dataset exactly once).
    """

    def __init__(self, datasets: List[MegatronDataset], weights: List[Union[int, float]], size: Optional[int],
                 config: BlendedMegatronDatasetConfig):
        if len(datasets) != len(weights):
            raise ValueError("BlendedDataset: one weight per dataset is required")
        if len(datasets) >= 32767:
            raise ValueError(f"BlendedDataset supports at most 32766 datasets, got {len(datasets)}")
        if not all(w > 0 for w in weights):
            raise ValueError(f"blend weights must be positive, got {weights}")
        if len(datasets) == 1:
            log_single_rank(logger, logging.WARNING, "Building a BlendedDataset for a single MegatronDataset")
        if size is not None:
            weights = normalize(weights)
        self.datasets = datasets
        self.split = datasets[0].index_split
        self.weights = weights
        self.size = size
        self.config = config

        unique_identifiers = OrderedDict()
        unique_identifiers["class"] = type(self).__name__
        unique_identifiers["datasets"] = [dataset.unique_identifiers for dataset in self.datasets]
        unique_identifiers["split"] = self.split.name
        unique_identifiers["weights"] = self.weights
        unique_identifiers["size"] = self.size
        self.unique_description = json.dumps(unique_identifiers, indent=4,
                                             default=lambda obj: obj.unique_identifiers)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()
        self.built_anew_on_cache_miss = False
        self.dataset_index, self.dataset_sample_index = self._build_indices()

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> Dict[str, Union[int, torch.Tensor, numpy.ndarray]]:
        dataset_id = self.dataset_index[idx]
        dataset_sample_id = self.dataset_sample_index[idx]
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][dataset_sample_id]}

    def _build_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray]:
        path_to_cache = self.config.path_to_cache
        paths = None
        if path_to_cache:
            base = f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}"
            paths = {k: os.path.join(path_to_cache, f"{base}-{k}")
                     for k in ("description.txt", "dataset_index.npy", "dataset_sample_index.npy")}
        cache_hit = paths is not None and all(os.path.isfile(p) for p in paths.values())
        is_rank_0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if paths is None or (not cache_hit and is_rank_0):
            return self._build_and_save(paths)
        log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} indices")
        if not cache_hit:
            raise RuntimeError(f"BlendedDataset index cache missing on this rank: {paths['description.txt']}")
        return (numpy.load(paths["dataset_index.npy"], allow_pickle=True, mmap_mode="r"),
                numpy.load(paths["dataset_sample_index.npy"], allow_pickle=True, mmap_mode="r"))

    def _build_and_save(self, paths):
        log_single_rank(logger, logging.INFO, f"Build and save the {type(self).__name__} indices")
        self.built_anew_on_cache_miss = True
        t_beg = time.time()
        if self.size is not None:
            dataset_index = numpy.zeros(self.size, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(self.size, dtype=numpy.int64)
            helpers.build_blending_indices(dataset_index, dataset_sample_index,
                                           numpy.asarray(self.weights, dtype=numpy.float64), len(self.datasets),
                                           self.size, _VERBOSE)
        else:
            size = int(sum(self.weights))
            dataset_index = numpy.zeros(size, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
            helpers.build_exhaustive_blending_indices(dataset_index, dataset_sample_index,
                                                      numpy.asarray(self.weights, dtype=numpy.int64),
                                                      len(self.datasets))
        if paths is not None:
            os.makedirs(os.path.dirname(paths["description.txt"]), exist_ok=True)
            with open(paths["description.txt"], "wt") as writer:
                writer.write(self.unique_description)
            numpy.save(paths["dataset_index.npy"], dataset_index, allow_pickle=True)
            numpy.save(paths["dataset_sample_index.npy"], dataset_sample_index, allow_pickle=True)
        log_single_rank(logger, logging.DEBUG, f"\t> time elapsed: {time.time() - t_beg:4f} seconds")
        return dataset_index, dataset_sample_index

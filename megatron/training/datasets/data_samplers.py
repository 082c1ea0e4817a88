"""Resumable batch samplers keyed by consumed samples, and the training data loader (COMPAT.md 4.6)."""
import random

import numpy
import torch

from megatron.core import parallel_state
from megatron.training.global_vars import get_args


def _data_parallel_rank_and_size():
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def build_pretraining_data_loader(dataset, consumed_samples, args=None, micro_batch_size=None, batch_sampler=None):
    """DataLoader over `dataset` resuming after `consumed_samples` (global count over all DP ranks).
    Megatron's API: ``args`` may be the caller's own namespace, so the loader flags have their defaults.
    ``micro_batch_size``: another than --micro-batch-size (the evaluation loaders' --eval-micro-batch-size);
    ``batch_sampler``: a sampler of the caller's own instead of --dataloader-type's (full validation)."""
    if dataset is None:
        return None
    if args is None:
        args = get_args()
    micro_batch_size = micro_batch_size or args.micro_batch_size
    dp_rank, dp_size = _data_parallel_rank_and_size()
    dataloader_type = getattr(args, "dataloader_type", None) or "single"
    if batch_sampler is None and dataloader_type == "single":
        batch_sampler = MegatronPretrainingSampler(
            total_samples=len(dataset), consumed_samples=consumed_samples, micro_batch_size=micro_batch_size,
            data_parallel_rank=dp_rank, data_parallel_size=dp_size)
    elif batch_sampler is None and dataloader_type == "cyclic":
        batch_sampler = MegatronPretrainingRandomSampler(
            dataset, total_samples=len(dataset), consumed_samples=consumed_samples,
            micro_batch_size=micro_batch_size, data_parallel_rank=dp_rank, data_parallel_size=dp_size,
            data_sharding=getattr(args, "data_sharding", True))
    elif batch_sampler is None and dataloader_type == "external":
        return dataset  # the user's own iterable/loader
    elif batch_sampler is None:
        raise ValueError(f"--dataloader-type {dataloader_type}: choose single, cyclic or external")
    num_workers = getattr(args, "num_workers", 2)
    # Its own generator: iterating a DataLoader draws a base seed, which must not advance the global torch
    # RNG (dropout on CPU), or resuming from a checkpoint would shift the random stream.
    generator = torch.Generator().manual_seed(getattr(args, "seed", 1234) or 0)
    # A dataset whose samples do not stack (image-text samples with varying image counts) names its own
    # collate_fn; None is torch's default.
    return torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler, num_workers=num_workers,
                                       collate_fn=getattr(dataset, "collate_fn", None),
                                       pin_memory=torch.cuda.is_available(),
                                       persistent_workers=num_workers > 0, generator=generator)


class MegatronPretrainingSampler:
    """Sequential: each chunk of MBS*DP indices gives DP rank r the slice [r*MBS, (r+1)*MBS)."""

    def __init__(self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                 data_parallel_size, drop_last=True):
        if total_samples <= 0:
            raise ValueError(f"no samples to train on (dataset of {total_samples} samples)")
        if consumed_samples >= total_samples:
            raise ValueError(f"consumed samples {consumed_samples} >= dataset size {total_samples}; "
                             "the run would read past the data (more --train-iters than data?)")
        if micro_batch_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError("--micro-batch-size must be positive and the DP rank within the DP size")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self):
        return self.total_samples

    def get_start_end_idx(self):
        start = self.data_parallel_rank * self.micro_batch_size
        return start, start + self.micro_batch_size

    def __iter__(self):
        batch = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.micro_batch_times_data_parallel_size:
                start, end = self.get_start_end_idx()
                yield batch[start:end]
                batch = []
        if batch and not self.drop_last:
            start, end = self.get_start_end_idx()
            yield batch[start:end]


class MegatronPretrainingRandomSampler:
    """Cyclic: a fresh permutation per epoch (seeded by the epoch), resumable mid-epoch."""

    def __init__(self, dataset, total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                 data_parallel_size, data_sharding=True):
        if total_samples <= 0:
            raise ValueError(f"no samples to train on (dataset of {total_samples} samples)")
        if micro_batch_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError("--micro-batch-size must be positive and the DP rank within the DP size")
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size
        if total_samples < self.micro_batch_times_data_parallel_size:
            raise ValueError(f"dataset of {total_samples} samples is smaller than one global micro-batch")

    def __len__(self):
        return self.total_samples

    def __iter__(self):
        active_total_samples = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total_samples
        current_epoch_samples = self.consumed_samples % active_total_samples
        assert current_epoch_samples % self.micro_batch_times_data_parallel_size == 0

        g = torch.Generator()
        g.manual_seed(self.epoch)
        if self.data_sharding:
            # each DP rank draws from its own contiguous bucket of the dataset
            bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size) * self.micro_batch_size
            bucket_offset = current_epoch_samples // self.data_parallel_size
            start_idx = self.data_parallel_rank * bucket_size
            random_idx = torch.randperm(bucket_size, generator=g).tolist()
            idx_range = [start_idx + x for x in random_idx[bucket_offset:]]
        else:
            full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            full_bucket_offset = current_epoch_samples
            idx_range_total = torch.randperm(full_bucket_size, generator=g).tolist()
            idx_range_active = idx_range_total[full_bucket_offset:]
            idx_range = idx_range_active[self.data_parallel_rank::self.data_parallel_size]

        batch = []
        for idx in idx_range:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []


def worker_init_fn(worker_id):
    """Distinct numpy/random seeds per loader worker."""
    seed = torch.initial_seed() % 2**32
    numpy.random.seed(seed)
    random.seed(seed)

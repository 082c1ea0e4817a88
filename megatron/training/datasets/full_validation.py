"""--full-validation: every evaluation reads the whole validation set exactly once.

Each DP rank takes the samples ``rank, rank + DP, ...`` in micro-batches; the last micro-batches are filled with
*padding* samples (a real sample with its loss mask zeroed) so that every rank runs the same number of micro-batches
per evaluation, a whole number of evaluation steps (--eval-global-batch-size). Padding adds nothing to the
token-weighted loss, so the reported loss is that of the whole set, each sample counted once; an evaluation
consumes exactly one pass of the sampler, so the next one starts again at the first sample."""
import math

import torch


def full_validation_steps(total_samples: int, micro_batch_size: int, data_parallel_size: int,
                          num_microbatches: int) -> int:
    """Evaluation steps (of ``num_microbatches`` micro-batches per rank) that cover ``total_samples`` once."""
    per_rank = math.ceil(total_samples / data_parallel_size)
    return math.ceil(math.ceil(per_rank / micro_batch_size) / num_microbatches)


class FullValidationSampler:
    """Batches of indices for one DP rank: its share of the set, then padding indices (``-1 - i`` for sample
    ``i``, which `PaddedValidationSet` returns with a zero loss mask) up to ``steps`` evaluation steps."""

    def __init__(self, total_samples: int, micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int,
                 num_microbatches: int, steps: int):
        if total_samples <= 0:
            raise ValueError(f"--full-validation: the validation set has no samples ({total_samples})")
        self.total, self.mbs, self.rank, self.dp = total_samples, micro_batch_size, data_parallel_rank, \
            data_parallel_size
        self.num_batches = steps * num_microbatches

    def __len__(self):
        return self.num_batches

    def __iter__(self):
        own = list(range(self.rank, self.total, self.dp))
        need = self.num_batches * self.mbs
        pad = [-1 - (i % self.total) for i in range(need - len(own))]
        indices = own + pad
        for b in range(self.num_batches):
            yield indices[b * self.mbs:(b + 1) * self.mbs]


class PaddedValidationSet(torch.utils.data.Dataset):
    """The validation dataset, where index ``-1 - i`` is sample ``i`` with its loss mask zeroed (padding)."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.collate_fn = getattr(dataset, "collate_fn", None)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, idx):
        if idx >= 0:
            return self.dataset[idx]
        sample = dict(self.dataset[-1 - idx])
        if "loss_mask" not in sample:
            raise ValueError(f"--full-validation pads the last batches with masked samples, but "
                             f"{type(self.dataset).__name__}'s samples have no loss_mask")
        mask = sample["loss_mask"]
        sample["loss_mask"] = torch.zeros_like(mask) if torch.is_tensor(mask) else mask * 0
        return sample

"""--full-validation's sampler: over the DP ranks every sample is read exactly once per evaluation, every rank
runs the same number of micro-batches (whole evaluation steps), and the rest is padding, which comes back with a
zero loss mask."""
import pytest
import torch

from megatron.training.datasets.full_validation import (
    FullValidationSampler,
    PaddedValidationSet,
    full_validation_steps,
)


@pytest.mark.parametrize("total,mbs,dp,nmb", [(23, 2, 2, 1), (23, 1, 1, 4), (5, 2, 4, 2), (64, 4, 2, 2), (1, 3, 2, 1)])
def test_every_sample_once_and_equal_batches(total, mbs, dp, nmb):
    steps = full_validation_steps(total, mbs, dp, nmb)
    per_rank = [list(FullValidationSampler(total, mbs, r, dp, nmb, steps)) for r in range(dp)]
    assert all(len(batches) == steps * nmb and all(len(b) == mbs for b in batches) for batches in per_rank)
    real = sorted(i for batches in per_rank for b in batches for i in b if i >= 0)
    assert real == list(range(total))
    assert all(-1 - i < total for batches in per_rank for b in batches for i in b if i < 0)
    # No whole evaluation step of padding only on every rank: the steps are the fewest that cover the set.
    assert (steps - 1) * nmb * mbs * dp < total


def test_padding_sample_has_a_zero_loss_mask():
    data = [{"tokens": torch.arange(4) + i, "loss_mask": torch.ones(4)} for i in range(3)]
    padded = PaddedValidationSet(data)
    assert torch.equal(padded[1]["loss_mask"], torch.ones(4))
    pad = padded[-1 - 1]
    assert torch.equal(pad["tokens"], data[1]["tokens"]) and torch.equal(pad["loss_mask"], torch.zeros(4))
    assert torch.equal(data[1]["loss_mask"], torch.ones(4))  # the dataset's own sample is left alone
    with pytest.raises(ValueError, match="samples have no loss_mask"):
        PaddedValidationSet([{"tokens": torch.arange(4)}])[-1]

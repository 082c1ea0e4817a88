"""Samplers resume by consumed samples; the data loader reads its args."""
from types import SimpleNamespace

import pytest

from megatron.training.datasets.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)


def test_single_sampler_slices_and_resume():
    full = [list(MegatronPretrainingSampler(50, 0, 2, r, 3)) for r in range(3)]
    assert full[0][0] == [0, 1] and full[1][0] == [2, 3] and full[2][1] == [10, 11]
    assert len(full[0]) == 50 // 6
    resumed = list(MegatronPretrainingSampler(50, 12, 2, 1, 3))
    assert resumed == full[1][2:]


def test_cyclic_sampler_resume_matches_uninterrupted():
    whole = MegatronPretrainingRandomSampler(None, 40, 0, 2, 0, 2)
    batches = list(whole)
    resumed = list(MegatronPretrainingRandomSampler(None, 40, 8, 2, 0, 2))
    assert resumed == batches[2:]
    assert sorted(i for b in batches for i in b) == sorted(set(i for b in batches for i in b))


def test_loader_reads_args():
    args = SimpleNamespace(dataloader_type="single", micro_batch_size=4, num_workers=0)
    loader = build_pretraining_data_loader(list(range(20)), 8, args=args)
    assert [b.tolist() for b in loader] == [[8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19]]
    with pytest.raises(ValueError, match="--dataloader-type"):
        build_pretraining_data_loader([1], 0, args=SimpleNamespace(dataloader_type="x", micro_batch_size=1))

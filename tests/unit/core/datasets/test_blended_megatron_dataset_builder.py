"""Rank 0 builds the index cache, the other rank waits at the barrier and loads it (gloo)."""
import numpy

from tests.parallel.dist_utils import run_distributed


def _build_on_two_ranks(prefix, cache):
    import torch

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.training.tokenizer.tokenizer import _NullTokenizer

    cfg = GPTDatasetConfig(random_seed=5, sequence_length=8, blend=([prefix], None), split="1,1,0",
                           path_to_cache=cache, tokenizer=_NullTokenizer(vocab_size=100), reset_position_ids=False,
                           reset_attention_mask=False, eod_mask_loss=False)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [40, 4, None], lambda: True, cfg).build()
    return torch.distributed.get_rank(), train.built_anew_on_cache_miss, [train[i]["tokens"].tolist()
                                                                         for i in range(5)]


def test_rank0_builds_cache_others_load(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "ds")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for i in range(30):
        builder.add_item(numpy.arange(i % 7 + 3) + i)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    (r0, built0, s0), (r1, built1, s1) = run_distributed(_build_on_two_ranks, 2, prefix, str(tmp_path / "c"))
    assert built0 and not built1 and s0 == s1

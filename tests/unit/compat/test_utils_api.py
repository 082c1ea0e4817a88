"""megatron.core utility names Megatron's scripts use: the straggler detector (off), the loaders that
refuse missing backends, the packed-batch / buffer / wgrad helpers and the weights_only allow-list."""
import argparse
import io

import pytest
import torch

from tests.fixtures.tiny_gpt import tiny_config


def test_straggler_detector_is_disabled_and_refuses_enabling():
    from megatron.core.utils import StragglerDetector
    stimer = StragglerDetector()
    with stimer:
        with stimer(bdata=True):
            pass
    assert stimer.report(1.0, 10) is False
    with pytest.raises(NotImplementedError, match="log-straggler"):
        stimer.configure(2, 0, enabled=True)


def test_loaders_refuse_missing_backends(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    from megatron.core.utils import get_batch_on_this_cp_rank
    prefix = str(tmp_path / "d")
    builder = IndexedDatasetBuilder(prefix + ".bin")
    builder.add_item(torch.tensor([1, 2, 3]))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    assert len(IndexedDataset(prefix, object_storage_config=None, fast_cache_load=False)) == 1
    with pytest.raises(NotImplementedError, match="S3"):
        IndexedDataset(prefix, s3_config={"bucket": "b"})
    batch = {"tokens": torch.arange(8).view(1, 8)}
    assert get_batch_on_this_cp_rank(batch, False)["tokens"] is batch["tokens"]  # CP size 1: unchanged
    with pytest.raises(NotImplementedError, match="hybrid"):
        get_batch_on_this_cp_rank(batch, is_hybrid_cp=True)


def _tiny_gpt_config():
    return tiny_config(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)


def test_batch_buffer_and_wgrad_helpers():
    from megatron.core.distributed.param_and_grad_buffer import group_params_for_buffers, shard_buffer
    from megatron.core.utils import (
        drain_embedding_wgrad_compute,
        flatten_batch_for_packed_sequences,
        prepare_input_tensors_for_wgrad_compute,
    )
    batch = {"tokens": torch.arange(8).view(2, 4), "labels": torch.arange(8).view(2, 4),
             "cu_seqlens": torch.tensor([[0, 1, 4, 4], [0, 4, 4, 4]], dtype=torch.int32),
             "max_seqlen": torch.tensor([3, 4], dtype=torch.int32)}
    out = flatten_batch_for_packed_sequences(batch)
    assert out["tokens"].shape == (1, 8) and out["cu_seqlens"].tolist() == [[0, 1, 4, 8]]
    assert out["max_seqlen"].tolist() == [4]
    buf = torch.arange(12.0)
    assert [s.tolist() for s in shard_buffer(buf, 3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    p16, p32 = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)), torch.nn.Parameter(torch.zeros(2))
    expert = torch.nn.Parameter(torch.zeros(2))
    expert.allreduce = False
    grouped = group_params_for_buffers([p16, p32, expert, p32], grad_reduce_in_fp32=True)
    assert {(k.param_dtype, k.is_expert_parallel): v[1] for k, v in grouped.items()} == {
        (torch.bfloat16, False): [0], (torch.float32, False): [0, 1], (torch.float32, True): [0]}
    w = torch.nn.Parameter(torch.zeros(5, 3))
    w.main_grad = torch.zeros(5, 3)
    xs, gs = [torch.randn(2, 1, 3) for _ in range(3)], [torch.randn(2, 1, 5) for _ in range(3)]
    expected = sum(g.reshape(-1, 5).t() @ x.reshape(-1, 3) for x, g in zip(xs, gs))
    assert prepare_input_tensors_for_wgrad_compute(gs[0], xs[0])[0].shape == (2, 5)
    drain_embedding_wgrad_compute(_tiny_gpt_config(), list(xs), list(gs), w, None)
    torch.testing.assert_close(w.main_grad, expected)


def test_safe_globals_allow_weights_only_load_of_megatron_objects():
    import megatron.core
    from megatron.core.enums import ModelType
    from megatron.core.optimizer import OptimizerConfig
    buf = io.BytesIO()
    torch.save({"args": argparse.Namespace(lr=0.5), "opt": OptimizerConfig(lr=2.0),
                "kind": ModelType.encoder_or_decoder, "rng": torch.Generator().get_state()}, buf)
    megatron.core.register_safe_globals()
    loaded = megatron.core.safe_load_from_bytes(buf.getvalue())
    assert loaded["args"].lr == 0.5 and loaded["opt"].lr == 2.0 and loaded["kind"] is ModelType.encoder_or_decoder

"""Megatron's multi-token-prediction API (megatron.core.transformer.multi_token_prediction): placement
helpers, spec builders with Megatron's signatures, packed-sequence rolling and the tied-weight replica
entries, single process; MTPLossLoggingHelper's accumulation, reduction and logging, on one process and on
2 gloo ranks (where mRoPE's context-parallel split and DDP's bucket groups are checked too)."""
import math

import pytest
import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
    get_gpt_mtp_block_spec_for_backend,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import multi_token_prediction as mtp
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from tests.fixtures.tiny_gpt import tiny_config
from tests.parallel.dist_utils import run_distributed


def _config(**kw):
    base = dict(hidden_size=16, num_attention_heads=2, mtp_num_layers=2, add_bias_linear=False)
    base.update(kw)
    return tiny_config(**base)


def test_roll_tensor_plain_and_packed():
    t = torch.arange(1, 9).view(1, 8)
    rolled, total = mtp.roll_tensor(t)
    assert rolled.tolist() == [[2, 3, 4, 5, 6, 7, 8, 0]] and total == 35
    packed = PackedSeqParams(cu_seqlens_q=torch.tensor([0, 3, 8]), cu_seqlens_kv=torch.tensor([0, 3, 8]),
                             qkv_format="thd")
    rolled, total = mtp.roll_tensor(t, packed_seq_params=packed)
    assert rolled.tolist() == [[2, 3, 0, 5, 6, 7, 8, 0]] and total == 31  # no token crosses a sequence end
    assert mtp.roll_tensor(None) == (None, None)


def test_placement_helpers_single_stage():
    config = _config()
    assert mtp.mtp_on_this_rank(mtp_num_layers=2) and not mtp.mtp_on_this_rank()
    assert mtp.get_mtp_ranks([0, 1, 2], config) == [2] and mtp.get_mtp_ranks([0], _config(mtp_num_layers=None)) == []
    assert mtp.get_mtp_layer_offset(config) == 0 and mtp.get_mtp_num_layers_to_build(config) == 2
    # A layout places MTP with the loss on the last stage (validated when parsed); a raw string is refused.
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    layout = PipelineParallelLayerLayout("Ettmm L", 1)
    layout.validate_layer_layout(2, 2)
    assert mtp.mtp_on_this_rank(layout=layout, mtp_num_layers=2)
    with pytest.raises(ValueError, match="parsed pipeline_model_parallel_layout"):
        mtp.mtp_on_this_rank(layout="Ettmm|L", mtp_num_layers=2)
    with pytest.raises(ValueError, match="MTP layers .m. are built on the last stage"):
        PipelineParallelLayerLayout("Ettm|mL", 2).validate_layer_layout(2, 2)


def test_megatron_style_provider_builds_mtp_and_trains():
    """The calls of Megatron's GPT model provider with MTP: TE-named layer spec, get_gpt_mtp_block_spec
    with use_transformer_engine=True. Same block as the backend form; the loss includes the MTP term."""
    config = _config()
    layer_spec = get_gpt_layer_with_transformer_engine_spec()
    block = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=True)
    from megatron.core.models.backends import LocalSpecProvider
    same = get_gpt_mtp_block_spec_for_backend(config, layer_spec, LocalSpecProvider())
    layer = block.submodules.layer_specs[0]
    assert (layer.submodules.mtp_model_layer is layer_spec
            and same.submodules.layer_specs[0].submodules == layer.submodules)
    torch.manual_seed(0)
    model = GPTModel(config, layer_spec, vocab_size=32, max_sequence_length=8, mtp_block_spec=block)
    assert len(model.mtp.layers) == 2 and model.mtp.layers[0].transformer_layer is not None
    ids = torch.randint(0, 32, (2, 8))
    pos = torch.arange(8).expand(2, 8)
    loss = model(ids, pos, None, labels=torch.roll(ids, -1, 1))
    loss.mean().backward()
    assert model.mtp.layers[1].eh_proj.weight.grad.abs().sum() > 0  # the MTP loss reaches the depths
    with pytest.raises(ValueError, match="needs both mtp_layer_pattern and hybrid_submodules"):
        mtp.MultiTokenPredictionBlock(config, block, mtp_layer_pattern="*")  # a hybrid depth without its layers


def test_tied_weight_entries_become_replicas():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    w = torch.randn(4, 3)
    sd = {"embedding.word_embeddings.weight": None, "output_layer.weight": None}
    mtp.tie_word_embeddings_state_dict(sd, w, "embedding.word_embeddings.weight", None, None)
    mtp.tie_output_layer_state_dict(sd, w, "output_layer.weight", None, None)
    for key, entry in sd.items():
        assert isinstance(entry, ShardedTensor) and entry.key == key and entry.replica_id == (1, 0, 0)
    with pytest.raises(KeyError):
        mtp.tie_output_layer_state_dict({}, w, "missing", None, None)


KV, SECTION, BASE = 16, [2, 3, 3], 10000  # rot_dim / 2 = 8 frequency bands: 2 temporal, 3 height, 3 width


def _positions(b=2, s=6, seed=0):
    return torch.randint(0, 50, (3, b, s), generator=torch.Generator().manual_seed(seed))


class _Recorder:
    """Collects what a TensorBoard / W&B writer receives."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, step):
        self.scalars[(name, step)] = float(value)

    def log(self, values, step):
        for name, value in values.items():
            self.scalars[(name, step)] = float(value)


def test_mtp_logging_helper_single_process():
    H = MTPLossLoggingHelper
    H.tracker.clear()
    # Two micro-batches, two depths: loss, correct predictions, valid positions.
    for loss, correct, total in ((0.5, 3, 4), (1.5, 1, 4)):
        H.save_metrics_to_tracker(torch.tensor(loss), torch.tensor(float(correct)), torch.tensor(float(total)), 0, 2)
        H.save_metrics_to_tracker(torch.tensor(2 * loss), torch.tensor(0.0), torch.tensor(0.0), 1, 2)
    H.save_metrics_to_tracker(torch.tensor(9.0), torch.tensor(1.0), torch.tensor(1.0), None, 2)  # not logged
    writer, wandb, totals = _Recorder(), _Recorder(), {"mtp_1 loss": torch.tensor(1.0)}
    H.track_mtp_metrics(0.5, 7, writer, wandb, totals)
    assert writer.scalars == wandb.scalars
    assert writer.scalars[("mtp_1 loss", 7)] == 1.0 and writer.scalars[("mtp_2 loss", 7)] == 2.0
    assert writer.scalars[("mtp_1_acceptance_rate", 7)] == 50.0
    assert writer.scalars[("mtp_2_acceptance_rate", 7)] == 0.0  # no valid position: 0, not NaN
    assert float(totals["mtp_1 loss"]) == 2.0 and float(totals["mtp_2 loss"]) == 2.0
    assert float(H.tracker["loss_values"].abs().sum()) == 0.0  # cleaned for the next iteration
    H.save_metrics_to_tracker(torch.tensor(1.0), torch.tensor(4.0), torch.tensor(4.0), 0, 2)
    H.track_mtp_metrics(1.0, 8, writer)
    assert writer.scalars[("mtp_1_acceptance_rate", 8)] == 100.0
    assert math.isclose(writer.scalars[("mtp_1_cumulative_acceptance_rate", 8)], 8 / 12 * 100.0, rel_tol=1e-6)
    H.tracker.clear()


def _two_ranks():
    rank = torch.distributed.get_rank()
    world = torch.distributed.group.WORLD
    H = MTPLossLoggingHelper
    H.save_metrics_to_tracker(torch.tensor(float(rank + 1)), torch.tensor(float(rank)), torch.tensor(2.0), 0, 1,
                              avg_group=world)
    writer = _Recorder()
    H.track_mtp_metrics(1.0, 1, writer)
    H.save_metrics_to_tracker(torch.tensor(float(rank + 1)), torch.tensor(1.0), torch.tensor(1.0), 0, 1,
                              reduce_group=world)
    H.track_mtp_metrics(1.0, 2, writer)
    # Context parallel: this rank's chunks (r, 2CP-1-r) of the 2CP-chunked sequence.
    pos = _positions(b=1, s=8)
    local = MultimodalRotaryEmbedding(KV, 1.0, cp_group=world)(pos, SECTION)
    full = MultimodalRotaryEmbedding(KV, 1.0)(pos, SECTION, cp_group=None)
    return writer.scalars, local, full, _bucket_groups()


def _net():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    net[1].to(torch.float64)  # a second dtype: a second buffer
    for p in net.parameters():
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = False, -1, 1
    return net


def _grads(net, x):
    """Plain autograd grads of one rank's batch (the reference)."""
    net.zero_grad()
    net[1](net[0](x).double()).sum().backward()
    return [p.grad.clone() for p in net.parameters()]


def _bucket_groups():
    """DDP with overlap: tiny buckets (one per param) in two buffers."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import partition_buckets
    parallel_state.initialize_model_parallel(1, 1)
    rank = torch.distributed.get_rank()
    cfg = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=1)
    out = {}
    xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    for disable in (False, True):
        model = DistributedDataParallel(None, cfg, _net(), disable_bucketing=disable)
        buckets = [b for buf in model.buffers for b in buf.buckets]
        sizes = [len(g.buckets) for g in model.bucket_groups]
        model.zero_grad_buffer()
        model.module[1](model.module[0](xs[rank]).double()).sum().backward()
        launched = all(b.grad_reduce_handle is not None for b in buckets)  # by the hooks, in backward
        model.finish_grad_sync()
        out[disable] = (len(model.buffers), len(buckets), sizes, launched,
                        [p.main_grad.clone() for p in model.module.parameters()])
        assert len(partition_buckets(model.buffers, force_single_bucket_group=True)) == 1
    ref = [(a + b) / 2 for a, b in zip(*[_grads(_net(), x) for x in xs])]
    return out, ref


def test_mtp_logging_reduction_and_mrope_cp_on_two_ranks():
    (s0, local0, full, (groups, ref)), (s1, local1, _, _) = run_distributed(_two_ranks, 2)
    assert s0 == s1
    assert s0[("mtp_1 loss", 1)] == 1.5  # averaged over the group
    assert s0[("mtp_1_acceptance_rate", 1)] == 25.0  # counts summed: 1 of 4
    assert s0[("mtp_1 loss", 2)] == 3.0  # summed over the reduce group
    assert math.isclose(s0[("mtp_1_cumulative_acceptance_rate", 2)], 3 / 6 * 100.0)
    torch.testing.assert_close(local0, torch.cat([full[0:2], full[6:8]]))
    torch.testing.assert_close(local1, torch.cat([full[2:4], full[4:6]]))

    # partition_buckets: one group per bucket (2 buffers, 1 bucket per param with bucket_size=1), or with
    # disable_bucketing (one bucket per buffer) both buffers' buckets in one group; grads reduced either way.
    for disable, (num_buffers, num_buckets, sizes, launched, grads) in groups.items():
        assert num_buffers == 2 and num_buckets == (2 if disable else 4) and launched
        assert sizes == ([2] if disable else [1, 1, 1, 1])
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r.to(g.dtype), rtol=1e-6, atol=1e-6)  # the mean of two sums

"""Megatron's multi-token-prediction API (megatron.core.transformer.multi_token_prediction): placement
helpers, spec builders with Megatron's signatures, packed-sequence rolling and the tied-weight replica
entries, single process."""
import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
    get_gpt_mtp_block_spec_for_backend,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import multi_token_prediction as mtp
from tests.fixtures.tiny_gpt import tiny_config


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
    with pytest.raises(NotImplementedError, match="pipeline-model-parallel-layout"):
        mtp.mtp_on_this_rank(layout=object(), mtp_num_layers=2)


def test_megatron_style_provider_builds_mtp_and_trains():
    """The calls of Megatron's GPT model provider with MTP: TE-named layer spec, get_gpt_mtp_block_spec
    with use_transformer_engine=True. Same block as the backend form; the loss includes the MTP term."""
    config = _config()
    layer_spec = get_gpt_layer_with_transformer_engine_spec()
    block = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=True)
    from megatron.core.models.backends import LocalSpecProvider
    same = get_gpt_mtp_block_spec_for_backend(config, layer_spec, LocalSpecProvider())
    layer = block.submodules.layer_specs[0]
    assert layer.submodules.mtp_model_layer is layer_spec and same.submodules.layer_specs[0].submodules == layer.submodules
    torch.manual_seed(0)
    model = GPTModel(config, layer_spec, vocab_size=32, max_sequence_length=8, mtp_block_spec=block)
    assert len(model.mtp.layers) == 2 and model.mtp.layers[0].transformer_layer is not None
    ids = torch.randint(0, 32, (2, 8))
    pos = torch.arange(8).expand(2, 8)
    loss = model(ids, pos, None, labels=torch.roll(ids, -1, 1))
    loss.mean().backward()
    assert model.mtp.layers[1].eh_proj.weight.grad.abs().sum() > 0  # the MTP loss reaches the depths
    with pytest.raises(NotImplementedError, match="hybrid"):
        mtp.MultiTokenPredictionBlock(config, block, mtp_layer_pattern="*")


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

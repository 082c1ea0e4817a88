"""Megatron Core's stacked-layer torch_dist layout (megatron/core/dist_checkpointing/megatron_layout.py), checked
without Megatron's wheel: the keys, shapes and offsets it gives our tiny GPT, and a save in it that our load reads
back. tests/functional/test_megatron_checkpoints.py checks the same layout against Megatron Core itself."""
import pytest
import torch

from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.megatron_layout import is_megatron_layout, to_megatron_layout
from megatron.core.dist_checkpointing.serialization import tensor_shapes
from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import MLATransformerConfig
from tests.fixtures.tiny_gpt import single_rank, tiny_config, tiny_gpt

FFN = 48


def _swiglu_gpt(seed):
    single_rank()
    torch.manual_seed(seed)
    config = tiny_config(num_layers=3, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                         ffn_hidden_size=FFN)
    return tiny_gpt(config)


def test_keys_shapes_and_offsets():
    model = _swiglu_gpt(0)
    out = to_megatron_layout(model.sharded_state_dict(), num_layers=3)
    norm = out["decoder.layers.2.input_layernorm.weight"]
    assert isinstance(norm, ShardedTensor)
    assert norm.key == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert (norm.global_shape, norm.global_offset, norm.prepend_axis_num) == ((3, 32), (2, 0), 1)
    assert out["decoder.layers.1.pre_mlp_layernorm.weight"].key == "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    assert out["decoder.layers.0.self_attention.linear_qkv.weight"].global_shape == (3, 96, 32)
    assert out["embedding.word_embeddings.weight"].key == "embedding.word_embeddings.weight"  # outside the layers
    fc1 = out["decoder.layers.1.mlp.linear_fc1.weight"]
    assert isinstance(fc1, ShardedTensorFactory)
    gate, up = fc1.build().values()  # ours [2, f, h] -> Megatron's [2f, h]: gate at 0, up at f
    assert gate.global_shape == up.global_shape == (3, 2 * FFN, 32)
    assert (gate.global_offset, up.global_offset) == ((1, 0, 0), (1, FFN, 0))
    assert torch.equal(up.data, model.decoder.layers[1].mlp.linear_fc1.weight.detach()[FFN:])
    extra = out["decoder.layers.0.mlp.linear_fc2._extra_state"]
    assert isinstance(extra, ShardedObject)
    assert extra.unique_key == "decoder.layers.mlp.linear_fc2._extra_state/shard_0_3"
    assert not any(k.endswith("layernorm._extra_state") for k in out)


def test_layer_outside_checkpoint_is_refused():
    with pytest.raises(ValueError, match=r"decoder.layers.2.input_layernorm.weight: layer 2 is outside a checkpoint "
                                         r"of 2 layers"):
        to_megatron_layout(_swiglu_gpt(0).sharded_state_dict(), num_layers=2)


def test_save_in_megatron_layout_loads_back(tmp_path):
    saved = _swiglu_gpt(0)
    ckpt = str(tmp_path / "c")
    dc.save_in_megatron_layout(saved.sharded_state_dict(), ckpt, num_layers=3)
    keys = tensor_shapes(ckpt)
    assert is_megatron_layout(keys) and "decoder.layers.0.input_layernorm.weight" not in keys
    assert keys["decoder.layers.mlp.linear_fc1.weight"][0] == (3, 2 * FFN, 32)
    # Megatron Core stores an object as the list of its copies.
    objs = torch_strategy.dcp_read(ckpt, {}, ["decoder.layers.self_attention.linear_qkv._extra_state/shard_1_3"])
    assert objs == {"decoder.layers.self_attention.linear_qkv._extra_state/shard_1_3": [None]}
    loaded = _swiglu_gpt(1)
    loaded.load_state_dict(dc.load(loaded.sharded_state_dict(), ckpt))
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def _moe_gpt(seed, grouped):
    single_rank()
    torch.manual_seed(seed)
    config = tiny_config(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False, moe_grouped_gemm=grouped,
                         gated_linear_unit=True, activation_func=torch.nn.functional.silu, ffn_hidden_size=FFN)
    return tiny_gpt(config, spec=get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=grouped))


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_experts_stack_on_an_expert_axis(grouped):
    out = to_megatron_layout(_moe_gpt(0, grouped).sharded_state_dict(), num_layers=2, num_experts=4)
    local = "decoder.layers.1.mlp.experts." + ("weight1" if grouped else "local_experts.2.linear_fc1.weight")
    gate, up = out[local].build().values()
    assert gate.key == up.key == "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert gate.global_shape == (2, 4, 2 * FFN, 32)
    assert (gate.global_offset, up.global_offset) == (((1, 0, 0, 0), (1, 0, FFN, 0)) if grouped else
                                                      ((1, 2, 0, 0), (1, 2, FFN, 0)))
    extras = sorted(o.unique_key for k, o in out.items() if k.endswith("._extra_state") and "layers.1.mlp" in k
                    and "fc2" in o.key)
    assert extras == [f"decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_1.{e}_2.4" for e in range(4)]


def test_sequential_experts_need_the_expert_count():
    with pytest.raises(ValueError, match=r"local_experts.0.linear_fc1.weight: a sequential expert; pass num_experts"):
        to_megatron_layout(_moe_gpt(0, False).sharded_state_dict(), num_layers=2)


def test_sequential_experts_save_loads_as_grouped(tmp_path):
    """Both expert layouts of ours meet in Megatron's: saved sequential, loaded grouped, the same weights."""
    saved, loaded = _moe_gpt(0, False), _moe_gpt(1, True)
    ckpt = str(tmp_path / "c")
    dc.save_in_megatron_layout(saved.sharded_state_dict(), ckpt, num_layers=2, num_experts=4)
    loaded.load_state_dict(dc.load(loaded.sharded_state_dict(), ckpt))
    for layer in range(2):
        experts = saved.decoder.layers[layer].mlp.experts.local_experts
        grouped = loaded.decoder.layers[layer].mlp.experts
        assert torch.equal(grouped.weight1.detach().reshape(4, 2 * FFN, 32),
                           torch.stack([e.linear_fc1.weight.detach() for e in experts]))
        assert torch.equal(grouped.weight2.detach(), torch.stack([e.linear_fc2.weight.detach() for e in experts]))


def test_mla_layers_keep_their_norm_names():
    """Megatron's MLA local spec has no sharded_state_dict_keys_map: its norms keep the local names."""
    single_rank()
    config = tiny_config(MLATransformerConfig, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
                         v_head_dim=8, normalization="RMSNorm")
    model = tiny_gpt(config, spec=get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm"),
                     position_embedding_type="rope")
    out = to_megatron_layout(model.sharded_state_dict(), num_layers=2)
    assert out["decoder.layers.1.input_layernorm.weight"].key == "decoder.layers.input_layernorm.weight"
    assert out["decoder.layers.1.pre_mlp_layernorm.weight"].key == "decoder.layers.pre_mlp_layernorm.weight"
    assert out["decoder.layers.0.self_attention.linear_q_up_proj._extra_state"].key == \
        "decoder.layers.self_attention.linear_q_up_proj._extra_state"


@pytest.mark.parametrize("saved_key, needle", [
    ("decoder.layers.mixer.in_proj.weight", "a Mamba / hybrid model .*pretrain_mamba.py"),
    ("vision_model.decoder.layers.self_attention.linear_qkv.weight", "multimodal .*pretrain_vlm.py"),
    ("decoder.layers.self_attention.linear_q_proj.weight", "another architecture.*--use-checkpoint-args")])
def test_checkpoint_of_another_architecture_is_one_line(tmp_path, saved_key, needle):
    """A Megatron checkpoint of a model family this run does not build: the missing tensor, what the checkpoint
    holds, and which entry script builds it."""
    dc.save({"x": ShardedTensor.from_rank_offsets(saved_key, torch.zeros(2, 4, 4))}, str(tmp_path))
    wanted = "decoder.layers.self_attention.linear_qkv.weight"
    with pytest.raises(dc.CheckpointingException, match=f"no tensor '{wanted}' that this model needs.*{needle}"):
        dc.load({"q": ShardedTensor.from_rank_offsets(wanted, torch.zeros(2, 12, 4))}, str(tmp_path))


def _te_extra_state(value):
    """Transformer Engine's saved extra state: a uint8 tensor of pickle bytes."""
    import pickle  # lazy: only this helper pickles
    return torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)


@pytest.mark.parametrize("fp8", [False, True])
def test_fp8_extra_state_is_found_in_a_megatron_layout_checkpoint(tmp_path, fp8):
    key = "decoder.layers.self_attention.linear_qkv._extra_state"
    state = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(1, 3)} if fp8 else None
    objs = {f"e{layer}": ShardedObject(key, [_te_extra_state(state if layer == 1 else None)], (2,), (layer,),
                                       replica_id=0) for layer in range(2)}  # Megatron stores [data]
    dc.save({**objs, "w": ShardedTensor.from_rank_offsets("decoder.layers.mlp.linear_fc2.weight",
                                                          torch.zeros(2, 4, 4))}, str(tmp_path))
    assert dc.fp8_extra_state_key(str(tmp_path)) == (f"{key}/shard_1_2" if fp8 else None)

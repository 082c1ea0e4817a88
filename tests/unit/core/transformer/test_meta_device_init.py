"""--init-model-with-meta-device: the layers allocate their weights on the meta device and the model materializes
and fills each once. The weights equal a normal build's bitwise (layout-independent init from the seed and each
parameter's global name) for a dense GPT with tied embeddings, an MoE GPT with grouped experts and a hybrid stack,
every parameter ends on a real device with its attributes (TP layout, init_fn) kept, and the model trains."""
import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.fixtures.tiny_gpt import VOCAB, single_rank, tiny_config


def _build(kind: str, meta: bool):
    single_rank()
    model_parallel_cuda_manual_seed(7)
    if kind == "hybrid":
        cfg = tiny_config(num_layers=4, ffn_hidden_size=64, normalization="RMSNorm", add_bias_linear=False,
                          mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, linear_key_head_dim=8,
                          linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                          is_hybrid_model=True, init_model_with_meta_device=meta)
        return HybridModel(cfg, get_hybrid_stack_spec(), VOCAB, 64, hybrid_layer_pattern="MG*-",
                           share_embeddings_and_output_weights=True, position_embedding_type="rope")
    extra = dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True, add_bias_linear=False,
                 moe_shared_expert_intermediate_size=16) if kind == "moe" else {}
    cfg = tiny_config(num_layers=2, init_model_with_meta_device=meta, **extra)
    spec = get_gpt_decoder_block_spec(cfg) if kind == "moe" else get_gpt_layer_local_spec()
    return GPTModel(cfg, spec, VOCAB, 64, share_embeddings_and_output_weights=True)


@pytest.mark.parametrize("kind", ["dense", "moe", "hybrid"])
def test_meta_device_build_equals_the_normal_build(kind):
    normal, meta = _build(kind, False), _build(kind, True)
    ours = dict(meta.named_parameters())
    assert not any(p.is_meta for p in ours.values())
    for name, p in normal.named_parameters():
        q = ours[name]
        assert torch.equal(p, q), name
        assert getattr(q, "init_fn", None) is not None, name
        for attr in ("tensor_model_parallel", "partition_dim", "allreduce", "sequence_parallel"):
            assert getattr(p, attr, None) == getattr(q, attr, None), (name, attr)
    if kind == "dense":  # the tied output layer reads the embedding's (materialized) weight
        assert meta.shared_embedding_or_output_weight() is meta.embedding.word_embeddings.weight
    ids = torch.randint(0, VOCAB, (2, 16))
    pos = torch.arange(16).unsqueeze(0).expand(2, -1)
    meta(ids, pos, None).float().square().mean().backward()
    assert all(p.grad is not None for p in meta.parameters() if p.requires_grad)

"""Multi-latent attention and MTP flags: one-line errors naming the flag, the mapping to
MLATransformerConfig, and the FLOPs they imply."""
import os

import pytest

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.transformer_config import MLATransformerConfig


def _args(extra, world_size=1):
    from megatron.training.arguments import parse_args, validate_args
    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
            "--micro-batch-size 2 --train-iters 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size 64 --multi-latent-attention ").split()
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world_size), "0"
    try:
        return validate_args(parse_args(argv=base + extra.split()))
    finally:
        del os.environ["WORLD_SIZE"], os.environ["RANK"]


@pytest.mark.parametrize("extra, world_size, message", [
    ("--kv-lora-rank 0", 1, "--kv-lora-rank (0) must be set"),
    ("--attention-backend flash --qk-head-dim 256", 1, "--attention-backend flash takes head dims up to 256"),
    ("--mtp-num-layers 1 --pipeline-model-parallel-size 2", 2, "--mtp-num-layers is not supported with "
                                                                "--pipeline-model-parallel-size > 1"),
    ("--group-query-attention --num-query-groups 2", 1, "--group-query-attention cannot be combined"),
    ("--context-parallel-size 2 --attention-dropout 0", 2,
     "--multi-latent-attention is not supported with --context-parallel-size"),
])
def test_bad_mla_and_mtp_flags_get_one_line(extra, world_size, message):
    from megatron.training.arguments import ArgumentError
    with pytest.raises(ArgumentError) as err:
        _args(extra, world_size)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_flags_map_to_mla_config_and_flops():
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.flops import num_floating_point_operations
    a = _args("--q-lora-rank 16 --kv-lora-rank 12 --qk-head-dim 8 --qk-pos-emb-head-dim 4 --v-head-dim 6 "
              "--rotary-scaling-factor 4 --mscale 0.9 --mscale-all-dim 0.7 --position-embedding-type yarn "
              "--yarn-original-max-position-embeddings 8 --yarn-beta-fast 16 --normalization RMSNorm "
              "--qk-layernorm --disable-bias-linear --swiglu --mtp-num-layers 1 --mtp-loss-scaling-factor 0.2")
    cfg = core_transformer_config_from_args(a)
    assert isinstance(cfg, MLATransformerConfig) and cfg.rope_type == "yarn"
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (
        16, 12, 8, 4, 6)
    assert (cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim) == (4.0, 0.9, 0.7)
    assert (cfg.original_max_position_embeddings, cfg.beta_fast, cfg.beta_slow) == (8, 16.0, 1)
    assert (cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor) == (1, 0.2)
    # FLOPs: every attention weight is used once per token (6 FLOPs: fwd + 2 bwd GEMMs, 2 per MAC), plus
    # the causal core attention; an MTP depth adds a layer, its eh_proj/norms and one more logits pass.
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    attn = MLASelfAttention(cfg, spec.submodules.self_attention.submodules, layer_number=1)
    attn_params = sum(p.numel() for p in attn.parameters())
    a.padded_vocab_size = 128
    h, s, f, layers = 32, a.seq_length, a.ffn_hidden_size, 2 + 1
    core = s * 4 * (8 + 4 + 6) / 2  # QK^T over qk + pe dims and AV over v dims, half under the causal mask
    expected = (layers * 6 * (3 * h * f + attn_params + core)  # SwiGLU MLP and attention per layer
                + 6 * (3 * h + 2 * h * h)  # MTP norms and eh_proj
                + 2 * 6 * h * 128)  # logits for the main head and the MTP depth
    assert num_floating_point_operations(a, 3) == pytest.approx(3 * s * expected, rel=1e-12)

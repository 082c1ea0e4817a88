"""DeepseekV3ForCausalLM <-> ours through the family-table converter, against a tiny random transformers model:
MLA with q/kv low rank, YaRN and interleaved rope rows, one dense layer then MoE layers (sigmoid router with a
random score-correction bias, group-limited routing, a shared expert), untied head.

fp32: both sides compute the same math in a different order (fused vs per-head projections, SDPA vs eager
attention, expert loops), ~1e-6 relative; 1e-4 relative on the logits is the acceptance bound.
"""
import os

import pytest
import torch

from tests.parallel.dist_utils import run_distributed

transformers = pytest.importorskip("transformers")
VOCAB, S, B = 64, 12, 2


def _hf_model():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=4,
        topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=16,
        kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                             beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or "e_score_correction_bias" in name:  # norms and router bias away from defaults
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
            else:
                p.normal_(0.0, 0.2)
        for name, buf in model.named_buffers():
            if "e_score_correction_bias" in name:
                buf.normal_(0.0, 0.2)
    return model


def _our_model(ckpt_dir):
    """pretrain_gpt's model, built from the flags the import saved, weights read from the checkpoint."""
    import pretrain_gpt
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from megatron.core.hf.dist_io import read_global
    from megatron.training import global_vars
    from megatron.training.checkpointing import paths
    from megatron.training.checkpointing.args import read_checkpoint_args
    args, iteration = read_checkpoint_args(ckpt_dir, None)
    args.micro_batch_size, args.bf16, args.params_dtype = 1, False, torch.float32
    global_vars._GLOBAL_ARGS = args
    model = pretrain_gpt.model_provider().eval()
    src = paths.get_checkpoint_name(ckpt_dir, iteration, return_base_dir=True)
    state = model.state_dict()
    names = [(n, 1) for n, _ in model.named_parameters()] + [(n, 1) for n in state if n.endswith("expert_bias")]
    tensors = read_global(src, names, load_tensors_metadata(src))  # gated fc1 stored [(E,) 2, f, h]
    model.load_state_dict({**state, **{n: t.reshape(state[n].shape) for n, t in tensors.items()}})
    return model, args


def _round_trip(tmp):
    """SequentialMLP experts, then --moe-grouped-gemm's GroupedMLP: logits in and out, tensors back."""
    from transformers import DeepseekV3ForCausalLM

    from megatron.core import parallel_state as ps
    from megatron.training.checkpointing.hf import export_hf_checkpoint, import_hf_checkpoint
    ps.initialize_model_parallel()
    hf = _hf_model()
    hf.save_pretrained(os.path.join(tmp, "hf"))
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(3))
    out = []
    for grouped in (False, True):
        ours_dir, back_dir = os.path.join(tmp, f"ours{int(grouped)}"), os.path.join(tmp, f"back{int(grouped)}")
        import_hf_checkpoint(os.path.join(tmp, "hf"), ours_dir, moe_grouped_gemm=grouped)
        ours, args = _our_model(ours_dir)
        with torch.no_grad():
            ref = hf(ids).logits
            got = ours(ids, torch.arange(S).expand(B, S), None)[..., :VOCAB]
            export_hf_checkpoint(ours_dir, back_dir)
            back = DeepseekV3ForCausalLM.from_pretrained(back_dir).float().eval()
            again = back(ids).logits
        same = {n: torch.equal(t, back.state_dict()[n]) for n, t in hf.state_dict().items()}
        out.append((ref, got, again, same, args.multi_latent_attention and args.num_experts and
                    args.moe_grouped_gemm == grouped))
    return out


def test_deepseek_v3_converts_both_ways(tmp_path):
    for ref, got, again, same, shape_ok in run_distributed(_round_trip, 1, str(tmp_path))[0]:
        assert shape_ok
        scale = ref.abs().max()
        assert (got - ref).abs().max() <= 1e-4 * scale, float((got - ref).abs().max() / scale)
        assert (again - ref).abs().max() <= 1e-4 * scale
        assert all(same.values()), [n for n, ok in same.items() if not ok]

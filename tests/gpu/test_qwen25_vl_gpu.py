"""Qwen2.5-VL's ViT and patch merger on CUDA against transformers' on the same GPU: a tiny random
Qwen2_5_VLForConditionalGeneration's vision weights, mapped with megatron/core/hf/qwen2_5_vl.py's rules, give
the same merged image features in fp32 (masked SDPA kernels vs transformers' per-window attention: 1e-4
relative) and close ones in bf16 (2e-2). Skipped without CUDA."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.hf.qwen2_5_vl import vision_rules
from megatron.core.models.multimodal.qwen25_vl_model import Qwen25VLModel  # noqa: F401  (import check)
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.qwen25_vl_vit_model import Qwen25VLVisionModel
from megatron.core.models.vision.vit_layer_specs import get_vision_projection_submodules, get_vit_layer_with_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
transformers = pytest.importorskip("transformers")
GRIDS = [(1, 16, 12), (1, 8, 8)]


def _hf(dtype):
    cfg = transformers.Qwen2_5_VLConfig(
        vision_config=dict(depth=4, hidden_size=64, intermediate_size=96, num_heads=4, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=64,
                           fullatt_block_indexes=[1, 3]),
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=None, eos_token_id=None,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
        image_token_id=120)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name or "ln_q" in name else 0.0, 0.1)
    return model.to("cuda", dtype), cfg.to_dict()


def _ours(cfg, hf_state, dtype):
    v = cfg["vision_config"]
    common = dict(hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                  bias_activation_fusion=False, add_bias_linear=True)
    vit_cfg = TransformerConfig(num_layers=v["depth"], hidden_size=v["hidden_size"], num_attention_heads=v["num_heads"],
                                ffn_hidden_size=v["intermediate_size"], gated_linear_unit=True, activation_func=F.silu,
                                add_qkv_bias=True, normalization="RMSNorm", layernorm_epsilon=1e-6, **common)
    merged = v["hidden_size"] * 4
    proj_cfg = TransformerConfig(num_layers=1, hidden_size=v["out_hidden_size"], num_attention_heads=4,
                                 ffn_hidden_size=merged, activation_func=F.gelu, **common)
    model_parallel_cuda_manual_seed(0)
    vit = Qwen25VLVisionModel(vit_cfg, get_vit_layer_with_local_spec(), patch_dim=v["patch_size"],
                              window_size=v["window_size"], full_attention_layers=v["fullatt_block_indexes"])
    proj = MultimodalProjector(proj_cfg, get_vision_projection_submodules(), "mlp", merged)
    state = {}
    hf_state = {k.replace("model.visual.", "visual."): t for k, t in hf_state.items()}
    for rule in vision_rules(cfg):
        state[rule.ours] = rule.transform.to_ours([hf_state[n] for n in rule.hf], None)
    vit.load_state_dict({k[len("vision_model."):]: t for k, t in state.items() if k.startswith("vision_model.")})
    proj.load_state_dict({k[len("vision_projection."):]: t for k, t in state.items()
                          if k.startswith("vision_projection.")})
    return vit.eval(), proj.eval()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_vision_features_match_transformers_on_cuda(dtype, tol, monkeypatch):
    # transformers' patch embedding is a Conv3d, which cuDNN runs in TF32 by default (~1e-3 relative); ours is the
    # linear it equals. Full fp32 on both sides for the 1e-4 comparison.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    hf, cfg = _hf(dtype)
    vit, proj = _ours(cfg, hf.state_dict(), dtype)
    grid = torch.tensor(GRIDS, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    patches = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, device="cuda", generator=g).to(dtype)
    with torch.no_grad():
        want = torch.cat(hf.model.get_image_features(patches, grid).pooler_output).float()
        got = proj(vit(patches, grid).unsqueeze(1)).squeeze(1).float()
    assert ((got - want).abs().max() / want.abs().max()).item() <= tol

"""Hugging Face <-> Megatron checkpoints: one small mapping table per model family.

Families: gpt2, llama (Llama 2/3/3.1), mistral, qwen2 (Qwen2/2.5), qwen3, mixtral, qwen3_moe, deepseek_v3
(routed experts for SequentialMLP or --moe-grouped-gemm's GroupedMLP, see moe.py), llava (CLIP ViT +
Llama/Mistral, for pretrain_vlm.py), qwen2_5_vl (Qwen2.5-VL: windowed ViT, patch merger, mRoPE decoder; pretrain_vlm.py
--vision-model-type qwen2.5_vit), and the hybrid models (pretrain_hybrid.py) mamba2, nemotron_h (their
Mamba-2 mixers in mamba.py) and qwen3_next. The checkpoint-level entry points (which also write args and the
tracker) are in ``megatron.training.checkpointing.hf``: ``import_hf_checkpoint`` / ``export_hf_checkpoint``.
"""
from . import (
    deepseek_v3,
    gpt2,
    llama,
    llava,
    mamba2,
    mistral,
    mixtral,
    nemotron_h,
    qwen2,
    qwen2_5_vl,
    qwen3,
    qwen3_moe,
    qwen3_next,
)
from .family import Family, Rule, UnsupportedConfig

FAMILIES = {m.FAMILY.name: m.FAMILY for m in (gpt2, llama, mistral, qwen2, qwen3, mixtral, qwen3_moe,
                                             deepseek_v3, llava, qwen2_5_vl, mamba2, nemotron_h, qwen3_next)}
_BY_ARCH = {arch: fam for fam in FAMILIES.values() for arch in fam.architectures}


def family_for_config(cfg: dict) -> Family:
    """The family of a config.json, or one line naming what is supported."""
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in _BY_ARCH:
            return _BY_ARCH[arch]
    raise UnsupportedConfig(f"config.json: architecture {', '.join(archs) or '(none)'} is not supported; "
                            f"supported: {', '.join(sorted(_BY_ARCH))}")


__all__ = ["FAMILIES", "Family", "Rule", "UnsupportedConfig", "family_for_config"]

"""Qwen3 (Qwen3ForCausalLM): Llama's tables plus per-head RMSNorm of q and k before RoPE.

| ours (decoder.layers.{i}.)        | Hugging Face (model.layers.{i}.)  |
|-----------------------------------|-----------------------------------|
| self_attention.q_layernorm.weight | self_attn.q_norm.weight [hn]      |
| self_attention.k_layernorm.weight | self_attn.k_norm.weight [hn]      |
(all other rows as in llama.py)
"""
from . import llama
from .family import Family, need


def rules(cfg: dict):
    return llama.rules(cfg, qk_norm=True)


def config_to_flags(cfg: dict):
    need(cfg, not cfg.get("attention_bias", False), "attention_bias=true")
    need(cfg, not cfg.get("use_sliding_window", False), "use_sliding_window=true")
    return llama.config_to_flags(cfg) + [("--qk-layernorm", None)]


def args_to_config(args, vocab_size: int) -> dict:
    cfg = llama.args_to_config(args, vocab_size)
    cfg.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=False)
    cfg.pop("mlp_bias")
    return cfg


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), rules=rules, config_to_flags=config_to_flags,
                args_to_config=args_to_config)

"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): Llama's tables plus biases on q/k/v (not on o_proj).

| ours (decoder.layers.{i}.)       | Hugging Face (model.layers.{i}.)                   |
|----------------------------------|----------------------------------------------------|
| self_attention.linear_qkv.bias   | self_attn.{q,k,v}_proj.bias, per group [q; k; v]   |
(all other rows as in llama.py)
"""
from . import llama
from .family import Family, need


def rules(cfg: dict):
    return llama.rules(cfg, qkv_bias=True)


def config_to_flags(cfg: dict):
    need(cfg, not cfg.get("use_sliding_window", False), "use_sliding_window=true")
    return llama.config_to_flags(cfg) + [("--add-qkv-bias", None)]


def args_to_config(args, vocab_size: int) -> dict:
    cfg = llama.args_to_config(args, vocab_size)
    cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False)
    for k in ("attention_bias", "mlp_bias"):
        cfg.pop(k)
    return cfg


FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), rules=rules, config_to_flags=config_to_flags,
                args_to_config=args_to_config)

"""Llama 2 / 3 / 3.1 (LlamaForCausalLM): RMSNorm, SwiGLU, RoPE (Llama 3.1 scaling), GQA, no biases.

| ours (decoder.layers.{i}.)            | Hugging Face (model.layers.{i}.)                       |
|---------------------------------------|--------------------------------------------------------|
| input_layernorm.weight                | input_layernorm.weight                                 |
| self_attention.linear_qkv.weight      | self_attn.{q,k,v}_proj.weight, per group [q; k; v]     |
| self_attention.linear_proj.weight     | self_attn.o_proj.weight                                |
| pre_mlp_layernorm.weight              | post_attention_layernorm.weight                        |
| mlp.linear_fc1.weight                 | mlp.{gate,up}_proj.weight, [gate; up]                  |
| mlp.linear_fc2.weight                 | mlp.down_proj.weight                                   |
| embedding.word_embeddings.weight      | model.embed_tokens.weight (vocab padded)               |
| decoder.final_layernorm.weight        | model.norm.weight                                      |
| output_layer.weight                   | lm_head.weight (absent when tie_word_embeddings)       |
"""
import math

from .family import Family, Rule, UnsupportedConfig, head_dim, need, rope_scaling, rope_theta
from .layout import GATE_UP, QKV, VOCAB

# Megatron's --use-rope-scaling fixes these (Llama 3.1); only the factor is a flag.
LLAMA3_SCALING = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def attention_rules(qkv_bias: bool = False, qk_norm: bool = False):
    a, h = "self_attention.", "self_attn."
    rules = [Rule(a + "linear_qkv.weight", tuple(f"{h}{x}_proj.weight" for x in "qkv"), QKV),
             Rule(a + "linear_proj.weight", (h + "o_proj.weight",))]
    if qkv_bias:
        rules.append(Rule(a + "linear_qkv.bias", tuple(f"{h}{x}_proj.bias" for x in "qkv"), QKV))
    if qk_norm:
        rules += [Rule(a + "q_layernorm.weight", (h + "q_norm.weight",)),
                  Rule(a + "k_layernorm.weight", (h + "k_norm.weight",))]
    return rules


def rules(cfg: dict, qkv_bias: bool = False, qk_norm: bool = False):
    glob = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB),
            Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
    if not cfg.get("tie_word_embeddings", False):
        glob.append(Rule("output_layer.weight", ("lm_head.weight",), VOCAB))
    layer = [Rule("input_layernorm.weight", ("input_layernorm.weight",)),
             Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
             Rule("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GATE_UP, stride=2),
             Rule("mlp.linear_fc2.weight", ("mlp.down_proj.weight",))]
    layer = attention_rules(qkv_bias, qk_norm) + layer
    return glob, [Rule("decoder.layers.{i}." + r.ours, tuple("model.layers.{i}." + n for n in r.hf),
                       r.transform, r.stride) for r in layer]


def _rope_flags(cfg: dict):
    theta = rope_theta(cfg)
    if float(theta) != int(theta):
        raise UnsupportedConfig(f"config.json: rope_theta {theta} is not an integer (--rotary-base takes an int)")
    flags = [("--position-embedding-type", "rope"), ("--rotary-base", int(theta))]
    scaling = rope_scaling(cfg)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise UnsupportedConfig(f"config.json: rope scaling type {kind!r} is not supported (only 'llama3')")
        for k, v in LLAMA3_SCALING.items():
            if not math.isclose(float(scaling.get(k, v)), v):
                raise UnsupportedConfig(f"config.json: rope scaling {k}={scaling[k]} is not supported "
                                        f"(--use-rope-scaling fixes it to {v})")
        flags += [("--use-rope-scaling", None), ("--rope-scaling-factor", float(scaling["factor"]))]
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        flags.append(("--rotary-percent", float(cfg["partial_rotary_factor"])))
    return flags


def config_to_flags(cfg: dict):
    """The Megatron flags that build this architecture."""
    need(cfg, cfg.get("hidden_act", "silu") == "silu", f"hidden_act {cfg.get('hidden_act')!r} (only silu)")
    need(cfg, not cfg.get("mlp_bias", False), "mlp_bias=true")
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    flags = [("--num-layers", cfg["num_hidden_layers"]), ("--hidden-size", cfg["hidden_size"]),
             ("--ffn-hidden-size", cfg["intermediate_size"]), ("--num-attention-heads", heads),
             ("--kv-channels", head_dim(cfg)), ("--max-position-embeddings", cfg["max_position_embeddings"])]
    if groups != heads:
        flags += [("--group-query-attention", None), ("--num-query-groups", groups)]
    flags += _rope_flags(cfg)
    flags += [("--normalization", "RMSNorm"), ("--norm-epsilon", cfg.get("rms_norm_eps", 1e-6)),
              ("--swiglu", None), ("--disable-bias-linear", None),
              ("--attention-dropout", float(cfg.get("attention_dropout", 0.0))), ("--hidden-dropout", 0.0)]
    if not cfg.get("tie_word_embeddings", False):
        flags.append(("--untie-embeddings-and-output-weights", None))
    return flags


def args_to_config(args, vocab_size: int) -> dict:
    """config.json fields of a Llama-shaped model built from ``args``."""
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention and args.num_query_groups else heads
    rope = {"rope_type": "default", "rope_theta": float(args.rotary_base)}
    if getattr(args, "use_rope_scaling", False):
        rope = dict(rope_type="llama3", rope_theta=float(args.rotary_base), factor=float(args.rope_scaling_factor),
                    **LLAMA3_SCALING)
    cfg = dict(hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
               num_hidden_layers=args.num_layers, num_attention_heads=heads, num_key_value_heads=groups,
               head_dim=args.kv_channels or args.hidden_size // heads, hidden_act="silu",
               max_position_embeddings=args.max_position_embeddings, rms_norm_eps=args.norm_epsilon,
               vocab_size=vocab_size, tie_word_embeddings=not args.untie_embeddings_and_output_weights,
               attention_bias=False, mlp_bias=False, attention_dropout=0.0, rope_theta=float(args.rotary_base),
               rope_scaling=rope if rope["rope_type"] != "default" else None, rope_parameters=rope)
    if args.rotary_percent != 1.0:
        cfg["partial_rotary_factor"] = args.rotary_percent
    return cfg


def _check_llama(cfg):
    need(cfg, not cfg.get("attention_bias", False), "attention_bias=true")


FAMILY = Family("llama", ("LlamaForCausalLM",), rules=lambda cfg: (_check_llama(cfg), rules(cfg))[1],
                config_to_flags=config_to_flags, args_to_config=lambda a, v: dict(
                    args_to_config(a, v), architectures=["LlamaForCausalLM"], model_type="llama"))

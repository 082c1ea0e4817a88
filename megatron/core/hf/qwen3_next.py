"""Qwen3-Next (Qwen3NextForCausalLM): Gated DeltaNet and gated full-attention layers, each followed by an MoE
(softmax router, gated shared expert) or a dense SwiGLU MLP; every RMSNorm zero-centred ((1 + w), our
--apply-layernorm-1p). HF layer j is our layers 2j (mixer: ``G`` or ``*``) and 2j + 1 (``E`` or ``-``).

| ours (decoder.layers.{2j}.) G                         | Hugging Face (model.layers.{j}.)                         |
|-------------------------------------------------------|----------------------------------------------------------|
| self_attention.in_proj.layer_norm_weight              | input_layernorm.weight                                   |
| self_attention.in_proj.weight.{query,key,value,z}     | linear_attn.in_proj_qkvz.weight, per key head [q;k;v;z]  |
| self_attention.in_proj.weight.{beta,alpha}            | linear_attn.in_proj_ba.weight, per key head [b; a]       |
| self_attention.conv1d.weight.{query,key,value}        | linear_attn.conv1d.weight, channels [q; k; v]            |
| self_attention.{A_log,dt_bias,out_proj.weight}        | linear_attn.{A_log,dt_bias,out_proj.weight}              |
| self_attention.out_norm.weight (w - 1: zero-centred)  | linear_attn.norm.weight (plain w)                        |
| ours (decoder.layers.{2j}.) *                         |                                                          |
| self_attention.linear_qkv.layer_norm_weight           | input_layernorm.weight                                   |
| self_attention.linear_qkv.weight, per group           | self_attn.q_proj.weight (per head [q; gate]), k_proj,    |
|   [q heads; their gates; k; v]                        |   v_proj                                                 |
| self_attention.{q,k}_layernorm.weight                 | self_attn.{q,k}_norm.weight                              |
| self_attention.linear_proj.weight                     | self_attn.o_proj.weight                                  |
| ours (decoder.layers.{2j+1}.) E / -                   |                                                          |
| pre_mlp_layernorm.weight / mlp.linear_fc1.layer_norm_weight | post_attention_layernorm.weight                    |
| mlp.router.weight, mlp.experts... (as qwen3_moe.py)   | mlp.gate.weight, mlp.experts.{e}.*                       |
| mlp.shared_experts.linear_fc1/fc2.weight, .gate_weight| mlp.shared_expert.{gate,up}/down_proj, shared_expert_gate|
| mlp.linear_fc1 / linear_fc2.weight (dense)            | mlp.{gate,up}_proj / down_proj.weight                    |
(embeddings, final norm and head as in llama.py; the multi-token-prediction weights are not converted)

The attention output gate is Megatron's --attention-output-gate; partial RoPE is --rotary-percent.
"""
import torch

from . import moe
from .family import Family, Rule, need, rope_theta
from .layout import VOCAB, Transform
from .mamba import part_of
from .qwen3_moe import num_experts

ZERO_CENTRED = Transform(lambda ts, d: ts[0] - 1, lambda t, d: [t + 1])  # HF plain w <-> our (1 + w) storage


def _gated_qkv(ts, d):
    q, k, v = ts  # q_proj [np * 2 * hn, h]: per head [q_h; gate_h]
    rest = q.shape[1:]
    per = d.num_heads // d.num_groups
    qg = q.reshape(d.num_heads, 2, d.head_dim, *rest)
    parts = [qg[:, 0].reshape(d.num_groups, per * d.head_dim, *rest), qg[:, 1].reshape(d.num_groups, per * d.head_dim,
                                                                                          *rest),
             k.reshape(d.num_groups, d.head_dim, *rest), v.reshape(d.num_groups, d.head_dim, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)  # per group [q heads; their gates; k; v]


def _gated_qkv_back(t, d):
    rest = t.shape[1:]
    per = d.num_heads // d.num_groups
    t = t.reshape(d.num_groups, 2 * (per + 1) * d.head_dim, *rest)
    q, gate, k, v = torch.split(t, [per * d.head_dim, per * d.head_dim, d.head_dim, d.head_dim], dim=1)
    qg = torch.stack([q.reshape(d.num_heads, d.head_dim, *rest), gate.reshape(d.num_heads, d.head_dim, *rest)], 1)
    return [qg.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous()]


GATED_QKV = Transform(_gated_qkv, _gated_qkv_back)


def layer_types(cfg: dict):
    """``layer_types``, or transformers' default: full attention every ``full_attention_interval`` layers."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    every = cfg.get("full_attention_interval", 4)
    return ["full_attention" if (j + 1) % every == 0 else "linear_attention" for j in range(cfg["num_hidden_layers"])]


def pattern(cfg: dict) -> str:
    """Our --hybrid-layer-pattern: per HF layer its mixer (G / *) then its MLP (E / -)."""
    kinds = layer_types(cfg)
    bad = [t for t in kinds if t not in ("linear_attention", "full_attention")]
    need(cfg, not bad, f"layer type {bad[0] if bad else ''!r}")
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
    sparse = [num_experts(cfg) > 0 and j not in dense and (j + 1) % step == 0 for j in range(len(kinds))]
    return "".join(("G" if t == "linear_attention" else "*") + ("E" if s else "-") for t, s in zip(kinds, sparse))


def _gdn_rules(cfg: dict, o: str, h: str):
    nk, nv, dk, dv = (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                      cfg["linear_value_head_dim"])
    r = nv // nk  # value heads per key head
    a, la = o + "self_attention.", h + "linear_attn."
    rules = [Rule(a + "in_proj.layer_norm_weight", (h + "input_layernorm.weight",))]
    start = 0
    for name, rows in (("query", dk), ("key", dk), ("value", r * dv), ("z", r * dv)):
        rules.append(Rule(f"{a}in_proj.weight.{name}", (la + "in_proj_qkvz.weight",), part_of(start, rows, nk)))
        start += rows
    rules += [Rule(a + "in_proj.weight.beta", (la + "in_proj_ba.weight",), part_of(0, r, nk)),
              Rule(a + "in_proj.weight.alpha", (la + "in_proj_ba.weight",), part_of(r, r, nk))]
    start = 0
    for name, rows in (("query", nk * dk), ("key", nk * dk), ("value", nv * dv)):
        rules.append(Rule(f"{a}conv1d.weight.{name}", (la + "conv1d.weight",), part_of(start, rows)))
        start += rows
    return rules + [Rule(a + "A_log", (la + "A_log",)), Rule(a + "dt_bias", (la + "dt_bias",)),
                    Rule(a + "out_norm.weight", (la + "norm.weight",), ZERO_CENTRED),
                    Rule(a + "out_proj.weight", (la + "out_proj.weight",))]


def _attention_rules(o: str, h: str):
    a, s = o + "self_attention.", h + "self_attn."
    return [Rule(a + "linear_qkv.layer_norm_weight", (h + "input_layernorm.weight",)),
            Rule(a + "linear_qkv.weight", tuple(f"{s}{x}_proj.weight" for x in "qkv"), GATED_QKV),
            Rule(a + "q_layernorm.weight", (s + "q_norm.weight",)),
            Rule(a + "k_layernorm.weight", (s + "k_norm.weight",)),
            Rule(a + "linear_proj.weight", (s + "o_proj.weight",))]


def _mlp_rules(cfg: dict, o: str, h: str, sparse: bool):
    if not sparse:
        rules = [Rule("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",))]
        rules += moe.mlp_rules("mlp.", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
        return [Rule(o + r.ours, tuple(h + n for n in r.hf), r.transform, r.stride) for r in rules]
    rules = [Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
             Rule("mlp.router.weight", ("mlp.gate.weight",))]
    rules += moe.routed_rules(num_experts(cfg), "mlp.experts.{e}.")
    if cfg.get("shared_expert_intermediate_size"):
        rules += moe.mlp_rules("mlp.shared_experts.", "mlp.shared_expert.gate_proj.weight",
                               "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight")
        rules.append(Rule("mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",)))
    return [Rule(o + r.ours, tuple(h + n for n in r.hf), r.transform, r.stride) for r in rules]


def rules(cfg: dict):
    glob = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB),
            Rule("decoder.final_norm.weight", ("model.norm.weight",))]
    if not cfg.get("tie_word_embeddings", False):
        glob.append(Rule("output_layer.weight", ("lm_head.weight",), VOCAB))
    p = pattern(cfg)

    def layer(i):  # our layer i is HF layer i // 2; our names keep {i} (state.py formats them)
        o, h = "decoder.layers.{i}.", f"model.layers.{i // 2}."
        symbol = p[i]
        if symbol == "G":
            return _gdn_rules(cfg, o, h)
        if symbol == "*":
            return _attention_rules(o, h)
        return _mlp_rules(cfg, o, h, symbol == "E")
    return glob, layer


def partial_rotary(cfg: dict) -> float:
    return float((cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor",
                                                                                           1.0)))


def config_to_flags(cfg: dict):
    """The Megatron flags that build this architecture (pretrain_hybrid.py)."""
    need(cfg, cfg.get("hidden_act", "silu") == "silu", f"hidden_act {cfg.get('hidden_act')!r} (only silu)")
    need(cfg, not cfg.get("attention_bias", False), "attention_bias=true")
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    need(cfg, params.get("rope_type", params.get("type", "default")) == "default", "rope scaling")
    theta = rope_theta(cfg)
    need(cfg, float(theta) == int(theta), f"rope_theta {theta} (--rotary-base takes an int)")
    p = pattern(cfg)
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    flags = [("--is-hybrid-model", None), ("--hybrid-layer-pattern", p), ("--num-layers", len(p)),
             ("--hidden-size", cfg["hidden_size"]), ("--ffn-hidden-size", cfg["intermediate_size"]),
             ("--num-attention-heads", heads), ("--kv-channels", cfg.get("head_dim") or cfg["hidden_size"] // heads),
             ("--max-position-embeddings", cfg["max_position_embeddings"]), ("--position-embedding-type", "rope"),
             ("--rotary-base", int(theta))]
    if partial_rotary(cfg) != 1.0:
        flags.append(("--rotary-percent", partial_rotary(cfg)))
    if groups != heads:
        flags += [("--group-query-attention", None), ("--num-query-groups", groups)]
    flags += [("--qk-layernorm", None), ("--attention-output-gate", None), ("--apply-layernorm-1p", None),
              ("--linear-num-key-heads", cfg["linear_num_key_heads"]),
              ("--linear-num-value-heads", cfg["linear_num_value_heads"]),
              ("--linear-key-head-dim", cfg["linear_key_head_dim"]),
              ("--linear-value-head-dim", cfg["linear_value_head_dim"]),
              ("--linear-conv-kernel-dim", cfg.get("linear_conv_kernel_dim", 4)),
              ("--normalization", "RMSNorm"), ("--norm-epsilon", cfg.get("rms_norm_eps", 1e-6)), ("--swiglu", None),
              ("--disable-bias-linear", None), ("--attention-dropout", float(cfg.get("attention_dropout", 0.0))),
              ("--hidden-dropout", 0.0)]
    if not cfg.get("tie_word_embeddings", False):
        flags.append(("--untie-embeddings-and-output-weights", None))
    if "E" in p:
        flags += [("--num-experts", num_experts(cfg)), ("--moe-ffn-hidden-size", cfg["moe_intermediate_size"]),
                  ("--moe-router-topk", cfg["num_experts_per_tok"])]
        if not cfg.get("norm_topk_prob", True):
            flags.append(("--moe-router-pre-softmax", None))
        if cfg.get("shared_expert_intermediate_size"):
            flags += [("--moe-shared-expert-intermediate-size", cfg["shared_expert_intermediate_size"]),
                      ("--moe-shared-expert-gate", None)]
    return flags


def args_to_config(args, vocab_size: int) -> dict:
    p = (args.hybrid_layer_pattern or "").replace("|", "")
    pairs = [p[k:k + 2] for k in range(0, len(p), 2)]
    if not p or any(len(x) != 2 or x[0] not in "G*" or x[1] not in "E-" for x in pairs):
        raise ValueError(f"--hybrid-layer-pattern {p!r}: Qwen3NextForCausalLM alternates a mixer (G or *) with an "
                         "MLP (E or -)")
    if not (args.attention_output_gate and args.apply_layernorm_1p and args.qk_layernorm and args.swiglu):
        raise ValueError("Qwen3NextForCausalLM needs --attention-output-gate, --apply-layernorm-1p, --qk-layernorm "
                         "and --swiglu")
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention and args.num_query_groups else heads
    cfg = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=vocab_size,
               hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size, num_hidden_layers=len(pairs),
               num_attention_heads=heads, num_key_value_heads=groups, head_dim=args.kv_channels or
               args.hidden_size // heads, hidden_act="silu", max_position_embeddings=args.max_position_embeddings,
               rms_norm_eps=args.norm_epsilon, tie_word_embeddings=not args.untie_embeddings_and_output_weights,
               rope_parameters={"rope_type": "default", "rope_theta": float(args.rotary_base),
                                "partial_rotary_factor": float(args.rotary_percent)},
               attention_bias=False, attention_dropout=0.0, linear_conv_kernel_dim=args.linear_conv_kernel_dim,
               linear_key_head_dim=args.linear_key_head_dim, linear_value_head_dim=args.linear_value_head_dim,
               linear_num_key_heads=args.linear_num_key_heads, linear_num_value_heads=args.linear_num_value_heads,
               layer_types=["linear_attention" if x[0] == "G" else "full_attention" for x in pairs],
               decoder_sparse_step=1, mlp_only_layers=[j for j, x in enumerate(pairs) if x[1] == "-"],
               num_experts=args.num_experts or 0, num_experts_per_tok=args.moe_router_topk,
               moe_intermediate_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
               shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size or 0,
               norm_topk_prob=not args.moe_router_pre_softmax, output_router_logits=False)
    return cfg


def expected_shape(name: str, cfg: dict, hidden: int, padded_vocab: int):
    heads = cfg["num_attention_heads"]
    groups, hd = cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or hidden // heads
    nk, nv, dk, dv = (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                      cfg["linear_value_head_dim"])
    ffn, shared = cfg["intermediate_size"], cfg.get("shared_expert_intermediate_size") or 0
    k = cfg.get("linear_conv_kernel_dim", 4)
    table = [("word_embeddings.weight", (padded_vocab, hidden)), ("output_layer.weight", (padded_vocab, hidden)),
             ("in_proj.weight.query", (nk * dk, hidden)), ("in_proj.weight.key", (nk * dk, hidden)),
             ("in_proj.weight.value", (nv * dv, hidden)), ("in_proj.weight.z", (nv * dv, hidden)),
             ("in_proj.weight.beta", (nv, hidden)), ("in_proj.weight.alpha", (nv, hidden)),
             ("conv1d.weight.query", (nk * dk, 1, k)), ("conv1d.weight.key", (nk * dk, 1, k)),
             ("conv1d.weight.value", (nv * dv, 1, k)), ("A_log", (nv,)), ("dt_bias", (nv,)),
             ("out_norm.weight", (dv,)), ("out_proj.weight", (hidden, nv * dv)),
             ("linear_qkv.weight", (2 * (heads + groups) * hd, hidden)), ("linear_proj.weight", (hidden, heads * hd)),
             ("q_layernorm.weight", (hd,)), ("k_layernorm.weight", (hd,)),
             ("shared_experts.linear_fc1.weight", (2 * shared, hidden)),
             ("shared_experts.linear_fc2.weight", (hidden, shared)), ("shared_experts.gate_weight", (1, hidden)),
             ("linear_fc1.weight", (2 * ffn, hidden)), ("linear_fc2.weight", (hidden, ffn))]
    for suffix, shape in table:
        if name.endswith(suffix):
            return shape
    return (hidden,)  # the norms


FAMILY = Family("qwen3_next", ("Qwen3NextForCausalLM",), rules=rules, config_to_flags=config_to_flags,
                args_to_config=args_to_config, expected_shape=expected_shape)

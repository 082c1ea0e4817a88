"""Nemotron-H (NemotronHForCausalLM): Mamba-2, attention (GQA, no position embedding) and squared-ReLU MLP
layers, one kind per layer, each ``x + mixer(norm(x))``; as our hybrid model with Megatron's pattern symbols.

The layer kinds: config.json's ``hybrid_override_pattern`` (hub checkpoints, Megatron's own string) or
``layers_block_type`` (transformers >= 5): ``linear_attention`` -> ``M``, ``full_attention`` -> ``*``,
``mlp`` -> ``-`` (``moe`` -> ``E``: not converted, see below).

| ours (decoder.layers.{i}.)                          | Hugging Face (backbone.layers.{i}.)             |
|-----------------------------------------------------|-------------------------------------------------|
| M: mixer.in_proj.layer_norm_weight, mixer.*         | norm.weight, mixer.* (as in mamba2.py)          |
| *: self_attention.linear_qkv.layer_norm_weight      | norm.weight                                     |
| *: self_attention.linear_qkv.weight                 | mixer.{q,k,v}_proj.weight, per group [q; k; v]  |
| *: self_attention.linear_proj.weight                | mixer.o_proj.weight                             |
| -: mlp.linear_fc1.layer_norm_weight                 | norm.weight                                     |
| -: mlp.linear_fc1.weight / mlp.linear_fc2.weight    | mixer.up_proj.weight / mixer.down_proj.weight   |
| embedding.word_embeddings.weight                    | backbone.embeddings.weight (vocab padded)       |
| decoder.final_norm.weight                           | backbone.norm_f.weight                          |
| output_layer.weight                                 | lm_head.weight (absent when tie_word_embeddings)|

transformers' NemotronH clamps the Mamba step dt at ``time_step_min`` from below; Megatron's mixer, which
trained these models, does not. The import keeps Megatron's semantics; logits differ from transformers' only
where softplus(dt) < time_step_min (1e-3).
Nemotron-3's MoE layers (sigmoid-routed squared-ReLU experts, latent projections) are refused for now.
"""
from . import mamba
from .family import Family, Rule, UnsupportedConfig, need
from .layout import QKV, VOCAB

_SYMBOL = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_KIND = {v: k for k, v in _SYMBOL.items()}


def pattern(cfg: dict) -> str:
    """Our --hybrid-layer-pattern from either config.json spelling."""
    if cfg.get("layers_block_type"):
        bad = [t for t in cfg["layers_block_type"] if t not in _SYMBOL]
        if bad:
            raise UnsupportedConfig(f"config.json: layers_block_type {bad[0]!r} is not a Nemotron-H layer kind")
        p = "".join(_SYMBOL[t] for t in cfg["layers_block_type"])
    else:
        p = cfg.get("hybrid_override_pattern") or ""
    need(cfg, bool(p) and set(p) <= {"M", "*", "-"},
         f"layer pattern {p!r} (Mamba 'M', attention '*' and MLP '-' layers only; MoE layers are not converted)")
    return p


def _dims(cfg: dict):
    return (cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg.get("n_groups", cfg.get("mamba_n_groups", 8)),
            cfg["ssm_state_size"])


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg.get("attention_head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def rules(cfg: dict):
    glob = [Rule("embedding.word_embeddings.weight", ("backbone.embeddings.weight",), VOCAB),
            Rule("decoder.final_norm.weight", ("backbone.norm_f.weight",))]
    if not cfg.get("tie_word_embeddings", False):
        glob.append(Rule("output_layer.weight", ("lm_head.weight",), VOCAB))
    o, h = "decoder.layers.{i}.", "backbone.layers.{i}."
    mixer = [Rule(o + "mixer.in_proj.layer_norm_weight", (h + "norm.weight",))]
    mixer += mamba.mixer_rules(o + "mixer.", h + "mixer.", *_dims(cfg))
    attention = [Rule(o + "self_attention.linear_qkv.layer_norm_weight", (h + "norm.weight",)),
                 Rule(o + "self_attention.linear_qkv.weight", tuple(f"{h}mixer.{x}_proj.weight" for x in "qkv"), QKV),
                 Rule(o + "self_attention.linear_proj.weight", (h + "mixer.o_proj.weight",))]
    mlp = [Rule(o + "mlp.linear_fc1.layer_norm_weight", (h + "norm.weight",)),
           Rule(o + "mlp.linear_fc1.weight", (h + "mixer.up_proj.weight",)),
           Rule(o + "mlp.linear_fc2.weight", (h + "mixer.down_proj.weight",))]
    by_symbol = {"M": mixer, "*": attention, "-": mlp}
    p = pattern(cfg)
    return glob, lambda i: by_symbol[p[i]]


def config_to_flags(cfg: dict):
    """The Megatron flags that build this architecture (pretrain_hybrid.py)."""
    mamba.check_mixer_config(dict(cfg, conv_kernel=cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4))),
                             "mamba_hidden_act", None)
    need(cfg, cfg.get("mlp_hidden_act", "relu2") == "relu2", f"mlp_hidden_act {cfg.get('mlp_hidden_act')!r} "
                                                             "(only relu2)")
    need(cfg, not cfg.get("attention_bias", False), "attention_bias=true")
    need(cfg, not cfg.get("mlp_bias", False), "mlp_bias=true")
    need(cfg, cfg.get("sliding_window") is None, "sliding_window")
    p = pattern(cfg)
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    flags = [("--is-hybrid-model", None), ("--hybrid-layer-pattern", p), ("--num-layers", len(p)),
             ("--hidden-size", cfg["hidden_size"]), ("--ffn-hidden-size", cfg["intermediate_size"]),
             ("--num-attention-heads", heads), ("--kv-channels", _head_dim(cfg)),
             ("--max-position-embeddings", cfg.get("max_position_embeddings", 4096)),
             ("--position-embedding-type", "none")]
    if groups != heads:
        flags += [("--group-query-attention", None), ("--num-query-groups", groups)]
    flags += mamba.mixer_flags(*_dims(cfg))
    flags += [("--normalization", "RMSNorm"), ("--norm-epsilon", cfg.get("layer_norm_epsilon", 1e-5)),
              ("--squared-relu", None), ("--disable-bias-linear", None),
              ("--attention-dropout", float(cfg.get("attention_dropout", 0.0))), ("--hidden-dropout", 0.0)]
    if not cfg.get("tie_word_embeddings", False):
        flags.append(("--untie-embeddings-and-output-weights", None))
    return flags


def args_to_config(args, vocab_size: int) -> dict:
    p = (args.hybrid_layer_pattern or "").replace("|", "")
    if not p or not set(p) <= {"M", "*", "-"}:
        raise ValueError(f"--hybrid-layer-pattern {p!r}: NemotronHForCausalLM holds Mamba 'M', attention '*' and "
                         "MLP '-' layers only")
    if not args.squared_relu or args.swiglu or args.position_embedding_type != "none":
        raise ValueError("NemotronHForCausalLM needs --squared-relu MLPs and --position-embedding-type none")
    heads = args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention and args.num_query_groups else heads
    return dict(architectures=["NemotronHForCausalLM"], model_type="nemotron_h", vocab_size=vocab_size,
                hidden_size=args.hidden_size, layers_block_type=[_KIND[s] for s in p], hybrid_override_pattern=p,
                num_hidden_layers=len(p), num_attention_heads=heads, num_key_value_heads=groups,
                head_dim=args.kv_channels or args.hidden_size // heads, intermediate_size=args.ffn_hidden_size,
                max_position_embeddings=args.max_position_embeddings, mlp_hidden_act="relu2",
                mamba_hidden_act="silu", mamba_num_heads=args.mamba_num_heads or
                2 * args.hidden_size // args.mamba_head_dim, mamba_head_dim=args.mamba_head_dim,
                n_groups=args.mamba_num_groups, ssm_state_size=args.mamba_state_dim, conv_kernel=4,
                use_conv_bias=True, use_bias=False, attention_bias=False, mlp_bias=False,
                layer_norm_epsilon=args.norm_epsilon, residual_in_fp32=False,
                tie_word_embeddings=not args.untie_embeddings_and_output_weights)


def expected_shape(name: str, cfg: dict, hidden: int, padded_vocab: int):
    heads = cfg["num_attention_heads"]
    groups, hd, ffn = cfg.get("num_key_value_heads") or heads, _head_dim(cfg), cfg["intermediate_size"]
    table = {"word_embeddings.weight": (padded_vocab, hidden), "output_layer.weight": (padded_vocab, hidden),
             "linear_qkv.weight": ((heads + 2 * groups) * hd, hidden), "linear_proj.weight": (hidden, heads * hd),
             "linear_fc1.weight": (ffn, hidden), "linear_fc2.weight": (hidden, ffn)}
    for suffix, shape in table.items():
        if name.endswith(suffix):
            return shape
    return mamba.mixer_shape(name, hidden, *_dims(cfg), 4) or (hidden,)


FAMILY = Family("nemotron_h", ("NemotronHForCausalLM",), rules=rules, config_to_flags=config_to_flags,
                args_to_config=args_to_config, expected_shape=expected_shape)

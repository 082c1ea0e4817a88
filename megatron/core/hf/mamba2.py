"""Mamba-2 (Mamba2ForCausalLM): every layer a Mamba-2 mixer, no attention, no position embedding; as our
hybrid model with the pattern ``M`` * num_hidden_layers.

| ours (decoder.layers.{i}.)                     | Hugging Face (backbone.layers.{i}.)                |
|------------------------------------------------|----------------------------------------------------|
| mixer.in_proj.layer_norm_weight                | norm.weight                                        |
| mixer.in_proj.weight.{z,x,B,C,dt}              | mixer.in_proj.weight, rows [z; x; B; C; dt]        |
| mixer.conv1d.weight.{x,B,C} / .bias.{x,B,C}    | mixer.conv1d.weight / bias, channels [x; B; C]     |
| mixer.{dt_bias,A_log,D,norm.weight}            | mixer.{dt_bias,A_log,D,norm.weight}                |
| mixer.out_proj.weight                          | mixer.out_proj.weight                              |
| embedding.word_embeddings.weight               | backbone.embeddings.weight (vocab padded)          |
| decoder.final_norm.weight                      | backbone.norm_f.weight                             |
| output_layer.weight                            | lm_head.weight (absent when tie_word_embeddings)   |
"""
from . import mamba
from .family import Family, Rule, need
from .layout import VOCAB


def _dims(cfg: dict):
    return cfg["num_heads"], cfg["head_dim"], cfg["n_groups"], cfg["state_size"]


def rules(cfg: dict):
    glob = [Rule("embedding.word_embeddings.weight", ("backbone.embeddings.weight",), VOCAB),
            Rule("decoder.final_norm.weight", ("backbone.norm_f.weight",))]
    if not cfg.get("tie_word_embeddings", False):
        glob.append(Rule("output_layer.weight", ("lm_head.weight",), VOCAB))
    layer = [Rule("decoder.layers.{i}.mixer.in_proj.layer_norm_weight", ("backbone.layers.{i}.norm.weight",))]
    layer += mamba.mixer_rules("decoder.layers.{i}.mixer.", "backbone.layers.{i}.mixer.", *_dims(cfg))
    return glob, layer


def config_to_flags(cfg: dict):
    """The Megatron flags that build this architecture (pretrain_hybrid.py / pretrain_mamba.py)."""
    mamba.check_mixer_config(cfg, "hidden_act", cfg.get("time_step_limit"))
    heads, head_dim, groups, state = _dims(cfg)
    need(cfg, heads * head_dim == cfg.get("expand", 2) * cfg["hidden_size"], "num_heads * head_dim != expand * hidden")
    layers = cfg["num_hidden_layers"]
    flags = [("--is-hybrid-model", None), ("--hybrid-layer-pattern", "M" * layers), ("--num-layers", layers),
             ("--hidden-size", cfg["hidden_size"]), ("--ffn-hidden-size", 4 * cfg["hidden_size"]),
             # no attention layer: the heads only have to satisfy the argument checks (TP divides the groups)
             ("--num-attention-heads", groups), ("--max-position-embeddings", 4096),
             ("--position-embedding-type", "none")]
    flags += mamba.mixer_flags(heads, head_dim, groups, state)
    flags += [("--normalization", "RMSNorm"), ("--norm-epsilon", cfg.get("layer_norm_epsilon", 1e-5)),
              ("--disable-bias-linear", None), ("--attention-dropout", 0.0), ("--hidden-dropout", 0.0)]
    if not cfg.get("tie_word_embeddings", False):
        flags.append(("--untie-embeddings-and-output-weights", None))
    return flags


def args_to_config(args, vocab_size: int) -> dict:
    pattern = args.hybrid_layer_pattern or ""
    if set(pattern) != {"M"}:
        raise ValueError(f"--hybrid-layer-pattern {pattern!r} has non-Mamba layers; Mamba2ForCausalLM holds only "
                         "'M' (export as NemotronHForCausalLM)")
    heads = args.mamba_num_heads or 2 * args.hidden_size // args.mamba_head_dim
    expand = heads * args.mamba_head_dim // args.hidden_size
    if expand * args.hidden_size != heads * args.mamba_head_dim:
        raise ValueError("Mamba2ForCausalLM needs --mamba-num-heads * --mamba-head-dim to be a multiple of "
                         "--hidden-size (its expand factor)")
    return dict(architectures=["Mamba2ForCausalLM"], model_type="mamba2", vocab_size=vocab_size,
                hidden_size=args.hidden_size, num_hidden_layers=args.num_layers, num_heads=heads,
                head_dim=args.mamba_head_dim, n_groups=args.mamba_num_groups, state_size=args.mamba_state_dim,
                expand=expand, conv_kernel=4, hidden_act="silu", use_bias=False, use_conv_bias=True,
                layer_norm_epsilon=args.norm_epsilon, residual_in_fp32=True,
                tie_word_embeddings=not args.untie_embeddings_and_output_weights)


def expected_shape(name: str, cfg: dict, hidden: int, padded_vocab: int):
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return (padded_vocab, hidden)
    return mamba.mixer_shape(name, hidden, *_dims(cfg), 4) or (hidden,)


FAMILY = Family("mamba2", ("Mamba2ForCausalLM",), rules=rules, config_to_flags=config_to_flags,
                args_to_config=args_to_config, expected_shape=expected_shape)

"""GPT-2 (GPT2LMHeadModel): LayerNorm with biases, learned positions, tanh-GeLU, tied embeddings.

HF's Conv1D layers store [in, out]; ours are [out, in], so every 2-D Conv1D weight is transposed.
c_attn is [h, 3h] = [q | k | v] columns; ours interleaves per head (GPT-2 has no GQA: one group per head).

| ours (decoder.layers.{i}.)             | Hugging Face (transformer.h.{i}.)        |
|----------------------------------------|------------------------------------------|
| input_layernorm.{weight,bias}          | ln_1.{weight,bias}                       |
| self_attention.linear_qkv.{weight,bias}| attn.c_attn.{weight,bias} (T, per head)  |
| self_attention.linear_proj.{weight,bias}| attn.c_proj.{weight,bias} (T)           |
| pre_mlp_layernorm.{weight,bias}        | ln_2.{weight,bias}                       |
| mlp.linear_fc1.{weight,bias}           | mlp.c_fc.{weight,bias} (T)               |
| mlp.linear_fc2.{weight,bias}           | mlp.c_proj.{weight,bias} (T)             |
| embedding.word_embeddings.weight       | transformer.wte.weight (vocab padded)    |
| embedding.position_embeddings.weight   | transformer.wpe.weight                   |
| decoder.final_layernorm.{weight,bias}  | transformer.ln_f.{weight,bias}           |
"""
from .family import Family, Rule, need
from .layout import CONV1D, CONV1D_QKV, VOCAB

_LAYER = [("input_layernorm", "ln_1", None), ("self_attention.linear_qkv", "attn.c_attn", CONV1D_QKV),
          ("self_attention.linear_proj", "attn.c_proj", CONV1D), ("pre_mlp_layernorm", "ln_2", None),
          ("mlp.linear_fc1", "mlp.c_fc", CONV1D), ("mlp.linear_fc2", "mlp.c_proj", CONV1D)]


# HF activation -> whether it is the tanh approximation (our --openai-gelu); "gelu" is exact erf GeLU.
_ACTS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}


def rules(cfg: dict):
    glob = [Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",), VOCAB),
            Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",))]
    glob += [Rule(f"decoder.final_layernorm.{p}", (f"transformer.ln_f.{p}",)) for p in ("weight", "bias")]
    layer = []
    for ours, hf, t in _LAYER:
        for p in ("weight", "bias"):
            rule = Rule(f"decoder.layers.{{i}}.{ours}.{p}", (f"transformer.h.{{i}}.{hf}.{p}",))
            layer.append(rule if t is None else Rule(rule.ours, rule.hf, t))
    return glob, layer


def config_to_flags(cfg: dict):
    act = cfg.get("activation_function", "gelu_new")
    need(cfg, act in _ACTS, f"activation_function {act!r} (use one of {', '.join(_ACTS)})")
    need(cfg, cfg.get("tie_word_embeddings", True), "tie_word_embeddings=false for GPT-2")
    need(cfg, cfg.get("scale_attn_weights", True) and not cfg.get("scale_attn_by_inverse_layer_idx", False)
         and not cfg.get("reorder_and_upcast_attn", False), "GPT-2 attention scaling variants")
    h = cfg["n_embd"]
    return [("--num-layers", cfg["n_layer"]), ("--hidden-size", h),
            ("--ffn-hidden-size", cfg.get("n_inner") or 4 * h), ("--num-attention-heads", cfg["n_head"]),
            ("--max-position-embeddings", cfg["n_positions"]), ("--position-embedding-type", "learned_absolute"),
            ("--normalization", "LayerNorm"), ("--norm-epsilon", cfg.get("layer_norm_epsilon", 1e-5)),
            *([("--openai-gelu", None)] if _ACTS[act] else []),
            ("--attention-dropout", float(cfg.get("attn_pdrop", 0.1))),
            ("--hidden-dropout", float(cfg.get("resid_pdrop", 0.1)))]


def args_to_config(args, vocab_size: int) -> dict:
    if not args.add_bias_linear or args.swiglu or args.normalization != "LayerNorm":
        raise ValueError("this checkpoint is not GPT-2 shaped (needs LayerNorm, biases, GeLU)")
    return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=args.hidden_size,
                n_layer=args.num_layers, n_head=args.num_attention_heads, n_inner=args.ffn_hidden_size,
                n_positions=args.max_position_embeddings, layer_norm_epsilon=args.norm_epsilon,
                activation_function="gelu_new" if args.openai_gelu else "gelu", vocab_size=vocab_size,
                tie_word_embeddings=True,
                attn_pdrop=args.attention_dropout, resid_pdrop=args.hidden_dropout,
                embd_pdrop=args.hidden_dropout)


FAMILY = Family("gpt2", ("GPT2LMHeadModel",), rules=rules, config_to_flags=config_to_flags,
                args_to_config=args_to_config)

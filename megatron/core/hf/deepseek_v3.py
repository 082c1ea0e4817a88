"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-latent attention with YaRN, the first layers dense and the rest
MoE (sigmoid router with a score-correction bias, group-limited routing, shared experts).

| ours (decoder.layers.{i}.)                         | Hugging Face (model.layers.{i}.)                    |
|----------------------------------------------------|-----------------------------------------------------|
| self_attention.linear_q_down_proj.weight           | self_attn.q_a_proj.weight                           |
| self_attention.q_layernorm.weight                  | self_attn.q_a_layernorm.weight                      |
| self_attention.linear_q_up_proj.weight             | self_attn.q_b_proj.weight (rope rows interleaved)   |
| self_attention.linear_q_proj.weight (no q lora)    | self_attn.q_proj.weight (rope rows interleaved)     |
| self_attention.linear_kv_down_proj.weight          | self_attn.kv_a_proj_with_mqa.weight (same)          |
| self_attention.kv_layernorm.weight                 | self_attn.kv_a_layernorm.weight                     |
| self_attention.linear_kv_up_proj.weight            | self_attn.kv_b_proj.weight                          |
| self_attention.linear_proj.weight                  | self_attn.o_proj.weight                             |
| mlp.linear_fc1/fc2.weight (dense layers)           | mlp.{gate,up}_proj / down_proj.weight               |
| mlp.router.weight, mlp.router.expert_bias          | mlp.gate.weight, mlp.gate.e_score_correction_bias   |
| mlp.experts.local_experts.{e}.linear_fc1/fc2.weight| mlp.experts.{e}.{gate,up}_proj / down_proj.weight   |
| mlp.shared_experts.linear_fc1/fc2.weight           | mlp.shared_experts.{gate,up}_proj / down_proj.weight|
(norms, embeddings and the head as in llama.py)

Our multi-latent attention, as Megatron Core's, keeps DeepSeek's weight layout (``rope_interleave``: the rotary
dims of each query head and of the shared rope key stored as pairs (x0, x1), (x2, x3)...) and reorders the
activations evens-then-odds before rotating halves; so those rows are copied as they are, and a checkpoint
without ``rope_interleave`` (halves) has them reordered into pairs on import and back on export. Routed experts
as in moe.py (SequentialMLP or grouped GEMM).
The multi-token prediction depth is not converted (transformers does not build it).
"""
import torch

from megatron.core.transformer.moe.moe_utils import moe_layer_pattern

from .family import Family, Rule, need, rope_scaling, rope_theta
from .layout import COPY, VOCAB, Transform
from .moe import mlp_rules


def _rope_perm(pe: int) -> torch.Tensor:
    return torch.cat([torch.arange(0, pe, 2), torch.arange(1, pe, 2)])


def _rope_rows(pe: int, block: int, heads: int) -> Transform:
    """Reorder the last ``pe`` rows of each of ``heads`` blocks of ``block`` rows: halves (HF) <-> pairs (ours)."""
    to_halves = torch.cat([torch.arange(block - pe), block - pe + _rope_perm(pe)])
    to_pairs = torch.argsort(to_halves)

    def apply(t, order):
        return t.reshape(heads, block, *t.shape[1:])[:, order].reshape(t.shape).contiguous()
    return Transform(lambda ts, d: apply(ts[0], to_pairs), lambda t, d: [apply(t, to_halves)])


def _layer_rules(cfg: dict, i: int):
    a, h = "self_attention.", "self_attn."
    n, nope, pe = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    interleaved = cfg.get("rope_interleave", True)
    q_rows = COPY if interleaved else _rope_rows(pe, nope + pe, n)
    kv_rows = COPY if interleaved else _rope_rows(pe, cfg["kv_lora_rank"] + pe, 1)
    rules = [Rule("input_layernorm.weight", ("input_layernorm.weight",)),
             Rule("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
             Rule(a + "linear_kv_down_proj.weight", (h + "kv_a_proj_with_mqa.weight",), kv_rows),
             Rule(a + "kv_layernorm.weight", (h + "kv_a_layernorm.weight",)),
             Rule(a + "linear_kv_up_proj.weight", (h + "kv_b_proj.weight",)),
             Rule(a + "linear_proj.weight", (h + "o_proj.weight",))]
    if cfg.get("q_lora_rank"):
        rules += [Rule(a + "linear_q_down_proj.weight", (h + "q_a_proj.weight",)),
                  Rule(a + "q_layernorm.weight", (h + "q_a_layernorm.weight",)),
                  Rule(a + "linear_q_up_proj.weight", (h + "q_b_proj.weight",), q_rows)]
    else:
        rules.append(Rule(a + "linear_q_proj.weight", (h + "q_proj.weight",), q_rows))
    if i < cfg.get("first_k_dense_replace", 0) or not cfg.get("n_routed_experts"):
        rules += _mlp_rules("mlp.", "mlp.")
    else:
        rules += [Rule("mlp.router.weight", ("mlp.gate.weight",)),
                  Rule("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",),
                       Transform(lambda ts, d: ts[0].float(), lambda t, d: [t]))]
        for e in range(cfg["n_routed_experts"]):
            rules += _mlp_rules(f"mlp.experts.local_experts.{e}.", f"mlp.experts.{e}.")
        if cfg.get("n_shared_experts"):
            rules += _mlp_rules("mlp.shared_experts.", "mlp.shared_experts.")
    return [Rule(f"decoder.layers.{i}." + r.ours, tuple(f"model.layers.{i}." + x for x in r.hf), r.transform,
                 r.stride) for r in rules]


def _mlp_rules(ours: str, hf: str):
    return mlp_rules(ours, hf + "gate_proj.weight", hf + "up_proj.weight", hf + "down_proj.weight")


def rules(cfg: dict):
    _check(cfg)
    glob = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB),
            Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
    if not cfg.get("tie_word_embeddings", False):
        glob.append(Rule("output_layer.weight", ("lm_head.weight",), VOCAB))
    return glob, lambda i: _layer_rules(cfg, i)


def expected_shape(name: str, cfg: dict, hidden: int, padded_vocab: int):
    """Global shape of one of our tensors under ``cfg`` (None: not a DeepSeek-V3 tensor name)."""
    n, nope, pe, v = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                      cfg["v_head_dim"])
    q_lora, kv_lora, E = cfg.get("q_lora_rank"), cfg["kv_lora_rank"], cfg.get("n_routed_experts") or 0
    moe_f, dense_f = cfg.get("moe_intermediate_size"), cfg["intermediate_size"]
    shared_f = (moe_f or 0) * (cfg.get("n_shared_experts") or 0)
    table = [("word_embeddings.weight", (padded_vocab, hidden)), ("output_layer.weight", (padded_vocab, hidden)),
             ("linear_q_down_proj.weight", (q_lora, hidden)), ("q_layernorm.weight", (q_lora,)),
             ("linear_q_up_proj.weight", (n * (nope + pe), q_lora)),
             ("linear_q_proj.weight", (n * (nope + pe), hidden)),
             ("linear_kv_down_proj.weight", (kv_lora + pe, hidden)), ("kv_layernorm.weight", (kv_lora,)),
             ("linear_kv_up_proj.weight", (n * (nope + v), kv_lora)), ("linear_proj.weight", (hidden, n * v)),
             ("router.weight", (E, hidden)), ("router.expert_bias", (E,)),
             ("shared_experts.linear_fc1.weight", (2 * shared_f, hidden)),
             ("shared_experts.linear_fc2.weight", (hidden, shared_f)),
             ("experts.linear_fc1.weight", (2 * (moe_f or 0), hidden)), ("experts.linear_fc2.weight", (hidden, moe_f)),
             ("mlp.linear_fc1.weight", (2 * dense_f, hidden)), ("mlp.linear_fc2.weight", (hidden, dense_f))]
    plain = name.split("local_experts.")[0] + "".join(name.split("local_experts.")[1].split(".", 1)[1:]) \
        if "local_experts." in name else name
    for suffix, shape in table:
        if plain.endswith(suffix):
            return shape
    return (hidden,)  # the norms


def _yarn_flags(cfg: dict):
    scaling = rope_scaling(cfg)
    if scaling is None:
        return [("--rope-type", "rope")]
    kind = scaling.get("rope_type", scaling.get("type"))
    need(cfg, kind == "yarn", f"rope scaling type {kind!r} (only yarn)")
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = float(scaling.get("mscale") or 1.0), float(scaling.get("mscale_all_dim") or 0.0)
    # transformers applies mscale/mscale_all_dim only when both are set (else 0.1 ln(factor) + 1), as ours
    # does exactly when mscale is 1 or mscale_all_dim is set.
    need(cfg, mscale_all_dim or mscale == 1.0, "yarn mscale without mscale_all_dim")
    need(cfg, scaling.get("attention_factor") is None, "yarn attention_factor")
    flags = [("--rope-type", "yarn"), ("--rotary-scaling-factor", factor), ("--mscale", mscale),
             ("--mscale-all-dim", mscale_all_dim),
             ("--yarn-original-max-position-embeddings", int(scaling["original_max_position_embeddings"])),
             ("--yarn-beta-fast", float(scaling.get("beta_fast", 32))),
             ("--yarn-beta-slow", float(scaling.get("beta_slow", 1)))]
    if not scaling.get("truncate", True):
        flags.append(("--no-yarn-correction-range-round-to-int", None))
    return flags


def _check(cfg: dict):
    need(cfg, cfg.get("hidden_act", "silu") == "silu", f"hidden_act {cfg.get('hidden_act')!r} (only silu)")
    need(cfg, not cfg.get("attention_bias", False), "attention_bias=true")
    if cfg.get("n_routed_experts"):
        need(cfg, cfg.get("norm_topk_prob", True), "norm_topk_prob=false (sigmoid scores are renormalised)")
        need(cfg, cfg.get("scoring_func", "sigmoid") == "sigmoid", f"scoring_func {cfg.get('scoring_func')!r}")
        groups, k = cfg.get("n_group") or 1, cfg["num_experts_per_tok"]
        # transformers scores a group by its top-2 experts; Megatron by its top (k / groups kept) experts.
        need(cfg, groups == 1 or k == 2 * (cfg.get("topk_group") or 1), "num_experts_per_tok != 2 * topk_group")


def config_to_flags(cfg: dict):
    """The Megatron flags that build this architecture."""
    _check(cfg)
    theta = rope_theta(cfg)
    need(cfg, float(theta) == int(theta), f"rope_theta {theta} (--rotary-base takes an int)")
    L = cfg["num_hidden_layers"]
    flags = [("--num-layers", L), ("--hidden-size", cfg["hidden_size"]),
             ("--ffn-hidden-size", cfg["intermediate_size"]), ("--num-attention-heads", cfg["num_attention_heads"]),
             ("--max-position-embeddings", cfg["max_position_embeddings"]), ("--multi-latent-attention", None),
             ("--kv-lora-rank", cfg["kv_lora_rank"]), ("--qk-head-dim", cfg["qk_nope_head_dim"]),
             ("--qk-pos-emb-head-dim", cfg["qk_rope_head_dim"]), ("--v-head-dim", cfg["v_head_dim"]),
             ("--qk-layernorm", None), ("--position-embedding-type", "rope"), ("--rotary-base", int(theta))]
    if cfg.get("q_lora_rank"):
        flags.append(("--q-lora-rank", cfg["q_lora_rank"]))
    flags += _yarn_flags(cfg)
    flags += [("--normalization", "RMSNorm"), ("--norm-epsilon", cfg.get("rms_norm_eps", 1e-6)), ("--swiglu", None),
              ("--disable-bias-linear", None), ("--attention-dropout", float(cfg.get("attention_dropout", 0.0))),
              ("--hidden-dropout", 0.0)]
    if not cfg.get("tie_word_embeddings", False):
        flags.append(("--untie-embeddings-and-output-weights", None))
    E = cfg.get("n_routed_experts")
    if E:
        k = min(cfg.get("first_k_dense_replace", 0), L)
        flags += [("--num-experts", E), ("--moe-layer-freq", f"([0]*{k}+[1]*{L - k})"),
                  ("--moe-ffn-hidden-size", cfg["moe_intermediate_size"]),
                  ("--moe-router-topk", cfg["num_experts_per_tok"]), ("--moe-router-score-function", "sigmoid"),
                  ("--moe-router-enable-expert-bias", None), ("--moe-router-dtype", "fp32"),
                  ("--moe-router-topk-scaling-factor", float(cfg.get("routed_scaling_factor", 1.0)))]
        if cfg.get("n_shared_experts"):
            flags.append(("--moe-shared-expert-intermediate-size",
                          cfg["moe_intermediate_size"] * cfg["n_shared_experts"]))
        if (cfg.get("n_group") or 1) > 1:
            flags += [("--moe-router-num-groups", cfg["n_group"]), ("--moe-router-group-topk", cfg["topk_group"])]
    return flags


def _leading_dense(args) -> int:
    pattern = moe_layer_pattern(args.moe_layer_freq, args.num_layers)
    k = pattern.index(1) if 1 in pattern else len(pattern)
    if any(p != 1 for p in pattern[k:]):
        raise ValueError(f"--moe-layer-freq {args.moe_layer_freq}: DeepSeek-V3 has dense layers first, then MoE")
    return k


def args_to_config(args, vocab_size: int) -> dict:
    """config.json fields of a DeepSeek-V3-shaped model built from ``args``."""
    if not getattr(args, "multi_latent_attention", False):
        raise ValueError("a DeepSeek-V3 export needs a --multi-latent-attention checkpoint")
    theta = float(args.rotary_base)
    rope = {"rope_type": "default", "rope_theta": theta}
    if (args.rope_type or "yarn") == "yarn":
        rope = dict(rope_type="yarn", rope_theta=theta, factor=float(args.rotary_scaling_factor),
                    original_max_position_embeddings=args.yarn_original_max_position_embeddings or 4096,
                    beta_fast=args.yarn_beta_fast or 32.0, beta_slow=args.yarn_beta_slow or 1.0,
                    mscale=float(args.mscale), mscale_all_dim=float(args.mscale_all_dim),
                    truncate=args.yarn_correction_range_round_to_int is not False)
    E = getattr(args, "num_experts", None)
    cfg = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=vocab_size,
               hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
               num_hidden_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
               num_key_value_heads=args.num_attention_heads, q_lora_rank=args.q_lora_rank,
               kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_head_dim,
               qk_rope_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
               head_dim=args.qk_pos_emb_head_dim, hidden_act="silu", rms_norm_eps=args.norm_epsilon,
               max_position_embeddings=args.max_position_embeddings, rope_interleave=True,
               tie_word_embeddings=not args.untie_embeddings_and_output_weights, attention_bias=False,
               attention_dropout=0.0, rope_theta=theta, rope_parameters=rope,
               rope_scaling=rope if rope["rope_type"] != "default" else None, num_nextn_predict_layers=0,
               first_k_dense_replace=args.num_layers, n_routed_experts=None, n_shared_experts=None)
    if E:
        shared = getattr(args, "moe_shared_expert_intermediate_size", None)
        moe_f = args.moe_ffn_hidden_size or args.ffn_hidden_size
        if shared and shared % moe_f:
            raise ValueError(f"--moe-shared-expert-intermediate-size ({shared}) must be a multiple of the expert "
                             f"size ({moe_f}) for DeepSeek-V3's n_shared_experts")
        cfg.update(n_routed_experts=E, moe_intermediate_size=moe_f, num_experts_per_tok=args.moe_router_topk,
                   n_shared_experts=(shared // moe_f) if shared else 0, first_k_dense_replace=_leading_dense(args),
                   routed_scaling_factor=args.moe_router_topk_scaling_factor or 1.0,
                   n_group=args.moe_router_num_groups or 1, topk_group=args.moe_router_group_topk or 1,
                   norm_topk_prob=True, scoring_func="sigmoid")
    return cfg


FAMILY = Family("deepseek_v3", ("DeepseekV3ForCausalLM",), rules=rules, config_to_flags=config_to_flags,
                args_to_config=args_to_config, expected_shape=expected_shape)

"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (GQA, per-head q/k RMSNorm) with MoE MLPs (softmax router,
no shared expert); the layers in ``mlp_only_layers`` or off ``decoder_sparse_step`` are dense.

| ours (decoder.layers.{i}.)                        | Hugging Face (model.layers.{i}.)                        |
|---------------------------------------------------|---------------------------------------------------------|
| mlp.router.weight                                 | mlp.gate.weight [E, h]                                  |
| mlp.experts.local_experts.{e}.linear_fc1.weight   | mlp.experts.{e}.{gate,up}_proj.weight, [gate; up]       |
| mlp.experts.local_experts.{e}.linear_fc2.weight   | mlp.experts.{e}.down_proj.weight                        |
| mlp.experts.weight1 [E, 2, f, h] (grouped GEMM)   | [gate_e; up_e] stacked over e                           |
| mlp.experts.weight2 [E, h, f] (grouped GEMM)      | down_e stacked over e                                   |
| mlp.linear_fc1 / linear_fc2.weight (dense layers) | mlp.{gate,up}_proj / down_proj.weight                   |
(attention with q_norm / k_norm as in qwen3.py; norms, embeddings and head as in llama.py)

Config <-> flags: ``moe_intermediate_size`` -> ``--moe-ffn-hidden-size``, ``intermediate_size`` (dense layers) ->
``--ffn-hidden-size``; ``norm_topk_prob=false`` -> ``--moe-router-pre-softmax`` (see moe.py). HF makes layer i
sparse when i is not in ``mlp_only_layers`` and (i + 1) % ``decoder_sparse_step`` == 0; Megatron's integer
``--moe-layer-freq N`` means i % N == 0, so anything but all-MoE is written as an explicit 0/1 list.
"""
from . import llama, moe, qwen3
from .family import Family, Rule, UnsupportedConfig, need


def num_experts(cfg: dict) -> int:
    """``num_experts`` (transformers < 5, hub configs) or ``num_local_experts`` (transformers >= 5)."""
    return int(cfg.get("num_experts", cfg.get("num_local_experts")) or 0)


def layer_pattern(cfg: dict):
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
    if not isinstance(step, int) or step < 1:
        raise UnsupportedConfig(f"config.json: decoder_sparse_step {step!r} is not supported (must be an int >= 1)")
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(cfg["num_hidden_layers"])]
    need(cfg, num_experts(cfg) > 0 and any(pattern),
         "a Qwen3-MoE model without MoE layers (num_experts=0, or mlp_only_layers / decoder_sparse_step leave "
         "every layer dense; save it as Qwen3ForCausalLM)")
    return pattern


def rules(cfg: dict):
    glob, layer = llama.rules(cfg, qk_norm=True)
    attention = [r for r in layer if ".mlp." not in r.ours]
    dense = [r for r in layer if ".mlp." in r.ours]
    sparse = moe.in_layer([Rule("mlp.router.weight", ("mlp.gate.weight",))] +
                          moe.routed_rules(num_experts(cfg), "mlp.experts.{e}."))
    pattern = layer_pattern(cfg)

    return glob, lambda i: attention + (sparse if pattern[i] else dense)  # names keep {i}: see state.py


def config_to_flags(cfg: dict):
    pattern = layer_pattern(cfg)
    return qwen3.config_to_flags(cfg) + moe.moe_flags(
        num_experts(cfg), cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], pattern,
        pre_softmax=not cfg.get("norm_topk_prob", False), aux_loss_coeff=cfg.get("router_aux_loss_coef", 0.0))


def args_to_config(args, vocab_size: int) -> dict:
    pattern = moe.softmax_router_args(args, "Qwen3-MoE")
    cfg = qwen3.args_to_config(args, vocab_size)
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=args.num_experts,
               num_experts_per_tok=args.moe_router_topk, moe_intermediate_size=args.moe_ffn_hidden_size or
               args.ffn_hidden_size, decoder_sparse_step=1, mlp_only_layers=[i for i, p in enumerate(pattern) if not p],
               norm_topk_prob=not args.moe_router_pre_softmax, router_aux_loss_coef=moe.aux_loss_coeff(args),
               output_router_logits=False)
    return cfg


FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), rules=rules, config_to_flags=config_to_flags,
                args_to_config=args_to_config)

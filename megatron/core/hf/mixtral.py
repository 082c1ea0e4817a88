"""Mixtral (MixtralForCausalLM): Mistral's attention (GQA, optional sliding window), every MLP a mixture of
experts (softmax router, top-k renormalised, no shared expert). ``intermediate_size`` is the expert size.

| ours (decoder.layers.{i}.)                        | Hugging Face (model.layers.{i}.)                         |
|---------------------------------------------------|----------------------------------------------------------|
| mlp.router.weight                                 | block_sparse_moe.gate.weight [E, h]                      |
| mlp.experts.local_experts.{e}.linear_fc1.weight   | block_sparse_moe.experts.{e}.{w1,w3}.weight, [w1; w3]    |
| mlp.experts.local_experts.{e}.linear_fc2.weight   | block_sparse_moe.experts.{e}.w2.weight                   |
| mlp.experts.weight1 [E, 2, f, h] (grouped GEMM)   | [w1_e; w3_e] stacked over e                              |
| mlp.experts.weight2 [E, h, f] (grouped GEMM)      | w2_e stacked over e                                      |
(w1 = gate, w3 = up, w2 = down; attention, norms, embeddings and head as in llama.py)

Routing: softmax over the top-k logits, Megatron's default (see moe.py). ``router_jitter_noise`` maps to
``--moe-input-jitter-eps`` (training only; Megatron jitters the router input, HF the experts' input too).
"""
from . import llama, mistral, moe
from .family import Family, Rule, need


def rules(cfg: dict):
    glob, layer = llama.rules(cfg)
    layer = [r for r in layer if ".mlp." not in r.ours]
    router = [Rule("mlp.router.weight", ("block_sparse_moe.gate.weight",))]
    experts = moe.routed_rules(cfg["num_local_experts"], "block_sparse_moe.experts.{e}.", ("w1", "w3", "w2"))
    return glob, layer + moe.in_layer(router + experts)


def config_to_flags(cfg: dict):
    need(cfg, cfg.get("num_local_experts", 0) > 0, "num_local_experts=0")
    L = cfg["num_hidden_layers"]
    flags = mistral.config_to_flags(cfg)
    flags += moe.moe_flags(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"], [1] * L,
                           pre_softmax=False, aux_loss_coeff=cfg.get("router_aux_loss_coef", 0.0))
    if cfg.get("router_jitter_noise"):
        flags.append(("--moe-input-jitter-eps", float(cfg["router_jitter_noise"])))
    return flags


def args_to_config(args, vocab_size: int) -> dict:
    pattern = moe.softmax_router_args(args, "Mixtral")
    if not all(pattern) or args.moe_router_pre_softmax or args.qk_layernorm or args.add_qkv_bias:
        raise ValueError("--moe-layer-freq with dense layers, --moe-router-pre-softmax, --qk-layernorm and "
                         "--add-qkv-bias have no Mixtral counterpart; export as Qwen3-MoE or another family")
    cfg = mistral.args_to_config(args, vocab_size)
    cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=args.num_experts,
               num_experts_per_tok=args.moe_router_topk,
               intermediate_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
               router_aux_loss_coef=moe.aux_loss_coeff(args), output_router_logits=False,
               router_jitter_noise=float(args.moe_input_jitter_eps or 0.0))
    return cfg


FAMILY = Family("mixtral", ("MixtralForCausalLM",), rules=rules, config_to_flags=config_to_flags,
                args_to_config=args_to_config)

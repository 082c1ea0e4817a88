"""A GPT model provider in the form of Megatron-LM's GPT example (gpt_builders.py + model_provider.py for
Megatron Core 0.19): flags -> TransformerConfig -> Transformer-Engine-named layer spec (a decoder block
spec with MoE) -> multi-token-prediction block spec -> GPTModel. It uses only Megatron's public API, as
such scripts do; the branches for modules Megatron Core 0.19 has but this package has not (legacy
models, YAML configs, heterogeneous layers, experimental attention variants) are left out."""
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.spec_utils import import_module
from megatron.training import get_args, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args


def _layer_spec(use_te, config):
    args = get_args()
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention,
            qk_l2_norm=args.qk_l2_norm, use_kitchen=config.use_kitchen,
            use_kitchen_attention=config.use_kitchen_attention,
            kitchen_attention_backend=config.kitchen_attention_backend)
    return get_gpt_layer_local_spec(
        args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention,
        normalization=args.normalization, use_kitchen=config.use_kitchen,
        use_kitchen_attention=config.use_kitchen_attention, kitchen_attention_backend=config.kitchen_attention_backend)


def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    print_rank_0("building GPT model ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    if args.spec is not None:
        layer_spec = import_module(args.spec)
    elif args.num_experts:
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                                qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    else:
        layer_spec = _layer_spec(use_te, config)
    mtp_block_spec = None
    if args.mtp_num_layers is not None:
        if hasattr(layer_spec, "layer_specs") and len(layer_spec.layer_specs) == 0:
            spec_for_mtp = _layer_spec(use_te, config)  # no decoder layer on this stage
        else:
            spec_for_mtp = get_gpt_decoder_layer_specs(config, use_transformer_engine=use_te,
                                                       normalization=args.normalization, qk_l2_norm=args.qk_l2_norm,
                                                       vp_stage=vp_stage)[-1]
        mtp_block_spec = get_gpt_mtp_block_spec(config, spec_for_mtp, use_transformer_engine=use_te, vp_stage=vp_stage)
    return GPTModel(
        config=config, transformer_layer_spec=layer_spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, mtp_block_spec=mtp_block_spec,
        vp_stage=vp_stage, pg_collection=pg_collection)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    return gpt_builder(get_args(), pre_process, post_process, vp_stage, config=config, pg_collection=pg_collection)

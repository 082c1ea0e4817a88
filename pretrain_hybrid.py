"""Pretrain a hybrid model (Mamba-2 / Gated DeltaNet / attention / MLP / MoE layers by --hybrid-layer-pattern):
`torchrun --nproc-per-node N pretrain_hybrid.py <Megatron flags>`. Data, batches and the loss are
pretrain_gpt.py's; only the model differs."""
from megatron.core.enums import ModelType
from megatron.core.models.hybrid import hybrid_layer_specs
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.training import get_args, pretrain, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.arguments.spec_args import resolve_spec
from pretrain_gpt import forward_step, train_valid_test_datasets_provider


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    """HybridModel built from the flags; state dicts use Megatron's hybrid (TE-spec) key names."""
    args = get_args()
    print_rank_0("building hybrid model ...")
    config = core_transformer_config_from_args(args)
    spec = resolve_spec(args.spec)
    if spec is hybrid_layer_specs.hybrid_stack_spec:
        # Megatron's launch scripts name this stack: the same layers, built with --qk-layernorm where it is set.
        spec = get_hybrid_stack_spec(moe_grouped_gemm=True, qk_layernorm=args.qk_layernorm)
    elif spec is None:
        spec = get_hybrid_stack_spec(moe_grouped_gemm=args.moe_grouped_gemm, qk_layernorm=args.qk_layernorm)
    return HybridModel(
        config=config, hybrid_stack_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, hybrid_layer_pattern=args.hybrid_layer_pattern,
        pre_process=pre_process, post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        vp_stage=vp_stage)


def extra_args_provider(parser):
    """This entry point builds hybrid models: --is-hybrid-model is on without being passed."""
    parser.set_defaults(is_hybrid_model=True)
    return parser


def run():
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             extra_args_provider=extra_args_provider, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})


if __name__ == "__main__":
    run()

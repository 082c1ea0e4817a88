"""--spec MODULE NAME builds the model from the named spec, as Megatron does: the GPT layer (a spec that differs from
the flags wins), the hybrid stack under Megatron's own module-level name (the name its launch scripts pass), BERT's
`local`; the entry points that do not read a layer spec refuse it."""
import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args
from tests.fixtures.tiny_gpt import single_rank

# Queries and keys normalised per head, though the flags below do not pass --qk-layernorm.
QK_NORM_LAYER_SPEC = get_gpt_layer_local_spec(qk_layernorm=True)
SIZES = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 1 --global-batch-size 1 --vocab-size 64 --tokenizer-type NullTokenizer --mock-data "
         "--train-iters 1 --lr 1e-3 --use-cpu-initialization")


def _build(provider, extra):
    single_rank()
    args = validate_args(parse_args(argv=(SIZES + " " + extra).split()))
    args.padded_vocab_size = 64  # set by the tokenizer at start-up
    global_vars._GLOBAL_ARGS = args
    torch.manual_seed(0)
    return provider()


def test_gpt_builds_the_named_layer_spec():
    import pretrain_gpt
    plain = _build(pretrain_gpt.model_provider, "")
    named = _build(pretrain_gpt.model_provider, f"--spec {__name__} QK_NORM_LAYER_SPEC")
    assert not any("q_layernorm" in n for n, _ in plain.named_parameters())
    assert any("q_layernorm" in n for n, _ in named.named_parameters())
    local = _build(pretrain_gpt.model_provider, "--spec local")
    assert [n for n, _ in local.named_parameters()] == [n for n, _ in plain.named_parameters()]


def test_hybrid_builds_megatron_s_stack_spec_name_with_its_grouped_experts():
    """Megatron's examples/mamba/train.sh passes this spec; Megatron's stack builds its experts as one grouped GEMM,
    so the run equals --moe-grouped-gemm without --spec, parameter for parameter."""
    import pretrain_hybrid
    pattern = ("--is-hybrid-model --hybrid-layer-pattern M*E --num-layers 3 --num-experts 4 --moe-ffn-hidden-size 16 "
               "--mamba-head-dim 16 --mamba-state-dim 16 --mamba-num-groups 2 --disable-bias-linear")
    named = _build(pretrain_hybrid.model_provider,
                   pattern + " --spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec")
    grouped = _build(pretrain_hybrid.model_provider, pattern + " --moe-grouped-gemm")
    sequential = _build(pretrain_hybrid.model_provider, pattern)
    names = [n for n, _ in named.named_parameters()]
    assert names == [n for n, _ in grouped.named_parameters()]
    assert names != [n for n, _ in sequential.named_parameters()]
    for (n, a), b in zip(named.named_parameters(), grouped.parameters()):
        assert torch.equal(a, b), n


def test_entry_points_without_one_layer_spec_refuse_it():
    import pretrain_t5
    args = validate_args(parse_args(argv=(SIZES + f" --spec {__name__} QK_NORM_LAYER_SPEC").split()))
    with pytest.raises(ValueError, match=r"^pretrain_t5.py: --spec is not read by this model"):
        pretrain_t5.check_t5_args(args)

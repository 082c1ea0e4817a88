"""TransformerConfig defaults and validation messages."""
import math

import pytest
import torch

from megatron.core.transformer.transformer_config import TransformerConfig


def _cfg(**kw):
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=8)
    base.update(kw)
    return TransformerConfig(**base)


def test_derived_defaults():
    c = _cfg()
    assert c.ffn_hidden_size == 256 and c.kv_channels == 8 and c.num_query_groups == 8
    w = torch.empty(20000)
    c.output_layer_init_method(w)
    assert abs(w.std().item() - 0.02 / math.sqrt(2 * 4)) < 5e-4


@pytest.mark.parametrize("kw,match", [
    (dict(tensor_model_parallel_size=3), "num_attention_heads"),
    (dict(num_query_groups=3), "num_query_groups"),
    (dict(normalization="BatchNorm"), "normalization"),
    (dict(recompute_granularity="full"), "recompute-method"),
    (dict(fp16=True, bf16=True), "fp16"),
])
def test_value_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


HCP = dict(context_parallel_size=4, attention_dropout=0.0, cp_comm_type="a2a+p2p")


@pytest.mark.parametrize("kw,match", [
    (dict(), "a2a\\+p2p needs --hierarchical-context-parallel-sizes A P"),
    (dict(cp_comm_type=["p2p", "a2a+p2p", "p2p", "p2p"]), "needs --hierarchical-context-parallel-sizes"),
    (dict(hierarchical_context_parallel_sizes=[2, 3]), "2 3 must be positive and multiply to --context-parallel-size"),
    (dict(hierarchical_context_parallel_sizes=[2, 1, 2]), "takes two --hierarchical-context-parallel-sizes"),
    (dict(hierarchical_context_parallel_sizes=[4, 1], tensor_model_parallel_size=4),
     "splits the 2 attention heads per TP rank over the all-to-all size 4"),
])
def test_hierarchical_context_parallel_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**{**HCP, **kw})


def test_hierarchical_context_parallel_per_layer():
    types = ["a2a+p2p", "p2p", "a2a", "a2a+p2p"]
    c = _cfg(**{**HCP, "cp_comm_type": types}, hierarchical_context_parallel_sizes=[2, 2])
    assert [c.cp_comm_type_of_layer(i) for i in (1, 2, 3, 4)] == types


def test_moe_config_checked():
    assert _cfg(num_moe_experts=4, moe_router_topk=2).num_moe_experts == 4
    with pytest.raises(ValueError, match="--moe-router-topk"):
        _cfg(num_moe_experts=4, moe_router_topk=5)


def test_sequence_parallel_off_at_tp1():
    assert _cfg(sequence_parallel=True).sequence_parallel is False


def test_compat_lists_hold_only_missing_fields():
    """A compat list names what is refused; a field the real config declares is implemented and must not be
    in it (a stale entry says 'not implemented' about a working feature)."""
    import dataclasses

    from megatron.core._compat_fields import ModelParallelConfigCompat
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed._compat_fields import DistributedDataParallelConfigCompat
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer._compat_fields import OptimizerConfigCompat
    from megatron.core.transformer._compat_fields import TransformerConfigCompat
    for config, mixin in ((ModelParallelConfig, ModelParallelConfigCompat),
                          (TransformerConfig, TransformerConfigCompat), (OptimizerConfig, OptimizerConfigCompat),
                          (DistributedDataParallelConfig, DistributedDataParallelConfigCompat)):
        declared = set(config.__dict__.get("__annotations__", {}))
        stale = sorted(f.name for f in dataclasses.fields(mixin) if f.name in declared)
        assert not stale, f"{mixin.__name__} lists fields that {config.__name__} implements: {stale}"


def test_autocast_fields_drive_the_schedule():
    """enable_autocast / autocast_dtype (ModelParallelConfig) run each forward step under torch.autocast."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = _cfg(enable_autocast=True, autocast_dtype=torch.bfloat16)
            self.linear = torch.nn.Linear(4, 4)

        def set_input_tensor(self, tensor):
            pass

        def forward(self, x):
            return self.linear(x)

    def forward_step(data_iterator, model):
        out = model(next(data_iterator))
        seen.append(out.dtype)
        return out, lambda o: (o.float().sum(), {"loss": o.float().sum().detach()})

    forward_backward_no_pipelining(forward_step_func=forward_step, data_iterator=iter([torch.ones(2, 4)]),
                                   model=[Model()], num_microbatches=1, seq_length=2, micro_batch_size=1,
                                   forward_only=True)
    assert seen == [torch.bfloat16]


def test_apply_wd_to_qk_layernorm_keeps_qk_norm_decay():
    from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides
    (key, override), = [(k, v) for k, v in get_standard_config_overrides(
        OptimizerConfig(lr=1.0, apply_wd_to_qk_layernorm=True)).items()]
    assert override == {"wd_mult": 0.0}
    predicate = key.with_name_predicate.fn
    norm = torch.nn.Parameter(torch.ones(4))
    assert predicate(norm, "decoder.layers.0.input_layernorm.weight")
    assert not predicate(norm, "decoder.layers.0.self_attention.q_layernorm.weight")


def test_hidden_size_default_zero_constructs_and_a_model_refuses_it():
    """Megatron constructs with its default hidden_size=0 (filled in later); building a model from it is
    refused in one line, and a negative size at construction."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    c = TransformerConfig(num_layers=2, num_attention_heads=4)
    assert (c.hidden_size, c.ffn_hidden_size, c.kv_channels) == (0, 0, 0)
    filled = dataclasses.replace(c, hidden_size=32, ffn_hidden_size=None, kv_channels=None)
    assert (filled.ffn_hidden_size, filled.kv_channels) == (128, 8)
    with pytest.raises(ValueError, match=r"hidden_size is 0 .*set it \(--hidden-size\) before building a model"):
        TransformerBlock(c, get_gpt_layer_local_spec())
    with pytest.raises(ValueError, match="TransformerConfig.hidden_size must be > 0, got -1"):
        _cfg(hidden_size=-1)


def test_warmup_flush_p2p_overlap_needs_overlap_p2p_comm():
    with pytest.raises(ValueError, match="drop --no-overlap-p2p-communication"):
        TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, overlap_p2p_comm_warmup_flush=True)
    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, overlap_p2p_comm=True,
                               overlap_p2p_comm_warmup_flush=True)
    assert config.overlap_p2p_comm_warmup_flush


def test_disable_bf16_reduced_precision_matmul_sets_torchs_switch():
    """--disable-bf16-reduced-precision-matmul with --bf16 turns off cuBLAS's reduced-precision split-K sums, as
    Megatron does (a process-wide torch setting); without --bf16 it leaves the setting alone."""
    import torch

    from megatron.core.transformer.transformer_config import TransformerConfig
    before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                          disable_bf16_reduced_precision_matmul=True)
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, bf16=True,
                          disable_bf16_reduced_precision_matmul=True)
        assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before

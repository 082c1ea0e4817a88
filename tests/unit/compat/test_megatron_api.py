"""Megatron Core's API used the way its docs and examples use it, in one process on CPU: build each
model from its specs and config, forward, backward, save and load through sharded_state_dict; the
microbatch calculators; the optimizer with its scheduler; the compat config fields."""
import dataclasses

import pytest
import torch

from megatron.core import dist_checkpointing
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.fixtures.tiny_gpt import tiny_config

VOCAB, SEQ, BATCH = 64, 16, 2


def _config(**kw):
    return tiny_config(use_cpu_initialization=True, **kw)


def _round_trip(model, tmp_path, run):
    """Backward through `run(model)`, save the sharded state dict, load it into a re-initialised copy
    of the model and check the loaded copy computes the same output. Exact: same fp32 ops, same data."""
    out = run(model)
    out.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    ckpt = str(tmp_path / "ckpt")
    dist_checkpointing.save(sharded_state_dict=model.sharded_state_dict(prefix=""), checkpoint_dir=ckpt)
    reference = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    loaded = dist_checkpointing.load(sharded_state_dict=model.sharded_state_dict(prefix=""), checkpoint_dir=ckpt)
    model.load_state_dict(loaded)
    for k, v in reference.items():
        assert torch.equal(model.state_dict()[k], v), k
    torch.testing.assert_close(run(model), out.detach(), rtol=0, atol=0)
    plain = dist_checkpointing.load_plain_tensors(ckpt)  # whole tensors under their global keys
    assert plain and all(torch.equal(plain[k], reference[k]) for k in plain if k in reference)


def test_gpt_from_te_named_spec(tmp_path):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    model_parallel_cuda_manual_seed(123)
    config = _config()
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False)
    # Without Transformer Engine the TE-named spec builds the local modules; only the checkpoint key names
    # differ (Megatron's TE-spec names, te_key_map.py).
    assert spec.submodules == dataclasses.replace(get_gpt_layer_local_spec().submodules,
                                                  checkpoint_key_names="transformer_engine")
    assert len(get_gpt_decoder_block_spec(config, use_transformer_engine=True).layer_specs) == 2
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope", share_embeddings_and_output_weights=True)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    assert model(tokens, position_ids, mask).shape == (BATCH, SEQ, VOCAB)  # logits without labels
    _round_trip(model, tmp_path, lambda m: m(tokens, position_ids, mask, labels=tokens))  # loss [b, s]
    with pytest.raises(NotImplementedError, match="use_te_op_fuser"):
        get_gpt_layer_with_transformer_engine_spec(use_te_op_fuser=True)


def test_bert_from_te_named_spec(tmp_path):
    from megatron.core.models.bert.bert_layer_specs import get_bert_layer_with_transformer_engine_spec
    from megatron.core.models.bert.bert_model import BertModel
    model_parallel_cuda_manual_seed(123)
    model = BertModel(config=_config(), num_tokentypes=2,
                      transformer_layer_spec=get_bert_layer_with_transformer_engine_spec(),
                      vocab_size=VOCAB, max_sequence_length=SEQ, add_binary_head=True)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    padding = torch.ones(BATCH, SEQ, dtype=torch.long)
    padding[1, SEQ // 2:] = 0
    types = torch.zeros(BATCH, SEQ, dtype=torch.long)

    def run(m):
        lm_loss, binary_logits = m(tokens, padding, tokentype_ids=types, lm_labels=tokens)
        return lm_loss.sum() + binary_logits.sum()
    _round_trip(model, tmp_path, run)


def test_t5_from_te_named_specs(tmp_path):
    from megatron.core.models.T5 import T5Model
    from megatron.core.models.T5.t5_model import encoder_config_from, t5_attention_masks
    from megatron.core.models.T5.t5_spec import (
        get_t5_decoder_with_transformer_engine_block_spec,
        get_t5_encoder_with_transformer_engine_block_spec,
    )
    model_parallel_cuda_manual_seed(123)
    config = _config()
    model = T5Model(config=config, encoder_config=encoder_config_from(config, 2),
                    transformer_encoder_layer_spec=get_t5_encoder_with_transformer_engine_block_spec(2),
                    transformer_decoder_layer_spec=get_t5_decoder_with_transformer_engine_block_spec(2),
                    vocab_size=VOCAB, max_sequence_length=SEQ)
    gen = torch.Generator().manual_seed(2)
    enc, dec = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, 8), generator=gen)
    masks = t5_attention_masks(torch.ones(BATCH, SEQ, dtype=torch.long), torch.ones(BATCH, 8, dtype=torch.long))
    _round_trip(model, tmp_path, lambda m: m(enc, dec, *masks, lm_labels=dec))


def test_microbatch_calculators():
    from megatron.core import num_microbatches_calculator as nmc
    nmc.destroy_num_microbatches_calculator()
    try:
        nmc.init_num_microbatches_calculator(0, None, 16, 2, 2)  # Megatron's positional call
        assert (nmc.get_num_microbatches(), nmc.get_current_global_batch_size()) == (4, 16)
        # Rampup 4 -> 16 by 4 over 300 samples: one increment per 100 samples.
        nmc.reconfigure_num_microbatches_calculator(0, [4, 4, 300], 16, 2, 1)
        seen = []
        for consumed in (0, 99, 100, 250, 301):
            nmc.update_num_microbatches(consumed, consistency_check=True)
            seen.append(nmc.get_current_global_batch_size())
        assert seen == [4, 4, 8, 12, 16]
        # Step schedule in tokens (seq 100): 1K tokens = 10 samples.
        nmc.reconfigure_num_microbatches_calculator(0, global_batch_size=None, micro_batch_size=2,
                                                    data_parallel_size=2, step_batch_size_schedule="0:8 1K:16",
                                                    seq_length=100)
        calc = nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR
        assert isinstance(calc, nmc.StepBatchsizeNumMicroBatchesCalculator)
        assert (nmc.get_num_microbatches(), calc.global_batch_size) == (2, 16)
        nmc.update_num_microbatches(10, consistency_check=True)
        assert nmc.get_num_microbatches() == 4
        with pytest.raises(ValueError, match="threshold 0"):
            nmc.StepBatchsizeNumMicroBatchesCalculator(2, 2, False, 0, "5:8")
    finally:
        nmc.destroy_num_microbatches_calculator()


def test_optimizer_scheduler_and_chained_optimizer():
    """get_megatron_optimizer + OptimizerParamScheduler; a ChainedOptimizer over two halves of a model
    takes the same steps as one optimizer over the whole model (one global grad norm, one clip)."""
    from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    torch.manual_seed(0)
    whole = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    parts = [torch.nn.Sequential(*[torch.nn.Linear(6, 4), torch.nn.Linear(4, 3)][i:i + 1]) for i in range(2)]
    with torch.no_grad():
        for src, dst in zip(whole, [parts[0][0], parts[1][0]]):
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)
    config = OptimizerConfig(optimizer="adam", lr=0.1, min_lr=0.01, weight_decay=0.0, clip_grad=0.05)
    single = get_megatron_optimizer(config, [whole])
    chained = ChainedOptimizer([get_megatron_optimizer(config, [p]) for p in parts])
    schedules = [OptimizerParamScheduler(opt, init_lr=0.0, max_lr=0.1, min_lr=0.01, lr_warmup_steps=2,
                                         lr_decay_steps=6, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                         wd_incr_steps=6, wd_incr_style="constant") for opt in (single, chained)]
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    lrs = []
    for _ in range(3):
        for opt, run in ((single, whole), (chained, lambda t: parts[1](parts[0](t)))):
            opt.zero_grad()
            run(x).pow(2).sum().backward()
        ok1, norm1, _ = single.step()
        ok2, norm2, _ = chained.step()
        assert ok1 and ok2 and norm1 == pytest.approx(norm2, rel=1e-6)  # fp32 sums in another order
        for sched in schedules:
            sched.step(increment=1)
        lrs.append(single.param_groups[0]["lr"])
        assert all(g["lr"] == lrs[-1] for g in chained.param_groups)
    for src, dst in zip(whole, [parts[0][0], parts[1][0]]):
        torch.testing.assert_close(dst.weight, src.weight, rtol=1e-6, atol=1e-7)
    assert lrs[0] == pytest.approx(0.05) and lrs[1] == pytest.approx(0.1) and lrs[2] < 0.1  # warmup, decay
    assert len(chained.state_dict()) == 2


def test_compat_config_fields():
    from megatron.core import ModelParallelConfig
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    # Megatron's fields are accepted at their defaults and refused, in one line, elsewhere.
    assert OptimizerConfig(grad_norm_skip_threshold=float("inf")).grad_norm_skip_threshold == float("inf")
    with pytest.raises(ValueError, match=r"OptimizerConfig.grad_norm_skip_threshold=1\.0"):
        OptimizerConfig(grad_norm_skip_threshold=1.0)
    with pytest.raises(ValueError, match="DistributedDataParallelConfig.reduce_scatter_with_fp32_accumulation"):
        DistributedDataParallelConfig(reduce_scatter_with_fp32_accumulation=True)
    with pytest.raises(ValueError, match="ModelParallelConfig.cross_entropy_loss_fusion"):
        ModelParallelConfig(cross_entropy_loss_fusion=True)
    assert _config(cross_entropy_loss_fusion=True).cross_entropy_loss_fusion  # a real TransformerConfig field
    # moe_* fields are read by Megatron only with experts: any value gives the same dense model.
    assert _config(moe_token_dispatcher_type="alltoall").moe_token_dispatcher_type == "alltoall"
    with pytest.raises(ValueError, match="TransformerConfig.fused_residual_rmsnorm"):
        _config(fused_residual_rmsnorm=True)

    @dataclasses.dataclass
    class WithFeature(TransformerConfig):  # a feature that lands redefines its field and takes it over
        fused_residual_rmsnorm: bool = False
    assert WithFeature(num_layers=1, hidden_size=8, num_attention_heads=2,
                       fused_residual_rmsnorm=True).fused_residual_rmsnorm


def test_small_core_names():
    """PackedSeqParams derives seq_idx; experimental APIs need the flag; strict flags are validated."""
    from megatron.core.config import set_experimental_flag
    from megatron.core.dist_checkpointing.validation import StrictHandling, parse_strict_flag
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.utils import ExperimentalNotEnabledError, experimental_fn
    p = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 5, 7, 11], dtype=torch.int32),
                        total_tokens=16)
    assert p.seq_idx.tolist() == [[0] * 5 + [1] * 2 + [2] * 4 + [3] * 5]
    double = experimental_fn(introduced_with_version="0.19.0")(lambda x: 2 * x)
    with pytest.raises(ExperimentalNotEnabledError):
        double(1)
    set_experimental_flag(True)
    try:
        assert double(2) == 4
    finally:
        set_experimental_flag(False)
    assert parse_strict_flag("log_all") is StrictHandling.LOG_ALL
    with pytest.raises(ValueError, match="strict flag 'nope' unknown"):
        parse_strict_flag("nope")

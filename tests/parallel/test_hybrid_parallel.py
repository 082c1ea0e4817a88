"""Hybrid models (Mamba-2, Gated DeltaNet, attention, MLP layers) under TP (with SP), PP (placed by the
pattern's '|'), DP with the distributed optimizer and CP (attention, MLP, Mamba-2 and Gated DeltaNet patterns) reproduce
one process:
fp32, dropout 0, same global batches, loss per iteration within 1e-5 relative (summation order only).
Then torch_dist checkpoints of model + optimizer reshard between TP=2, PP=2 and one rank. Multi-token prediction
depths from the pattern ('/', each a hybrid stack of Mamba-2 and MLP layers) train under TP=2 + SP and DP=2 like
one process, and their checkpoint reshards TP=2 -> one rank. Multi-latent attention layers ('+') beside Mamba-2 and
standard attention train under TP=2 + SP like one process."""
import torch

from megatron.core import parallel_state as ps
from megatron.core.context_parallel import get_batch_on_this_cp_rank
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from tests.fixtures.tiny_gpt import VOCAB, global_batch, loss_func, tiny_config, train_step
from tests.parallel.dist_utils import run_distributed

RTOL = 1e-5
STEPS = 4
PATTERN = "M*G-"


MTP_PATTERN = "M*G-/M-/M-"  # two MTP depths
CP_MAMBA = "M*M-"  # Mamba-2 layers under CP: each of the 2 ranks scans the whole sequence for 1 of the 2 groups
CP_GDN = "G*G-"  # Gated DeltaNet under CP: each rank runs 1 of the 2 key heads (2 value heads each), whole sequence


def _build(pattern=PATTERN, tp=1, pp=1, cp=1, distopt=False, sp=False, groups=2):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp)
    model_parallel_cuda_manual_seed(1234)
    mla = "+" in pattern  # multi-latent attention layers need the MLA config and its sizes
    mla_sizes = dict(q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
                     rotary_base=10000) if mla else {}
    cfg = tiny_config(MLATransformerConfig if mla else TransformerConfig, **mla_sizes,
                      num_layers=len(pattern.split("/")[0].replace("|", "")), ffn_hidden_size=64,
                      normalization="RMSNorm", add_bias_linear=False,
                      mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=groups, linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                      is_hybrid_model=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                      context_parallel_size=cp, sequence_parallel=sp,
                      mtp_num_layers=pattern.count("/") or None)
    model = HybridModel(cfg, get_hybrid_stack_spec(), VOCAB, 64, hybrid_layer_pattern=pattern,
                        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                        share_embeddings_and_output_weights=True, position_embedding_type="rope")
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=distopt,
                                                                       bucket_size=4000), model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=3e-3, weight_decay=0.01, clip_grad=1.0,
                                                 use_distributed_optimizer=distopt), [model])
    return model, opt


def _cp_forward_step(data_iterator, model):
    """The tiny GPT's forward step with each CP rank keeping its two load-balanced sequence chunks."""
    tokens = next(data_iterator)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
             "position_ids": torch.arange(tokens.size(1) - 1).expand(tokens.size(0), -1)}
    batch = get_batch_on_this_cp_rank(batch)
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]), loss_func


def _losses(layout, steps=STEPS):
    model, opt = _build(**layout)
    step_fn = _cp_forward_step if layout.get("cp", 1) > 1 else None
    kwargs = {"forward_step_func": step_fn} if step_fn else {}
    losses = [train_step(model, opt, global_batch(it), **kwargs)[0] for it in range(steps)]
    ps.destroy_model_parallel()
    return losses


def _close(name, got, expected):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL, atol=0,
                               msg=lambda m: f"{name}: {m}")


def _two_rank_layouts():
    return {"tp2_sp": _losses(dict(tp=2, sp=True)), "pp2_pipe": _losses(dict(pattern="M*G|-", pp=2)),
            "dp2_distopt": _losses(dict(distopt=True)), "cp2": _losses(dict(pattern="*-*-", cp=2)),
            "cp2_mamba": _losses(dict(pattern=CP_MAMBA, cp=2)), "cp2_gdn": _losses(dict(pattern=CP_GDN, cp=2))}


def _single_references():
    return {"hybrid": _losses({}), "attention": _losses(dict(pattern="*-*-")),
            "cp2_mamba": _losses(dict(pattern=CP_MAMBA)), "cp2_gdn": _losses(dict(pattern=CP_GDN))}


def test_tp_pp_dp_cp_equal_one_process():
    ref = run_distributed(_single_references, 1)[0]
    assert ref["hybrid"][-1] < ref["hybrid"][0]
    for rank_results in run_distributed(_two_rank_layouts, 2):
        for name, losses in rank_results.items():
            same = {"cp2": "attention", "cp2_mamba": "cp2_mamba", "cp2_gdn": "cp2_gdn"}  # else the hybrid pattern
            _close(name, losses, ref[same.get(name, "hybrid")])


def _sharded(model, opt, is_loading=False):
    model_sd = model.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading)}


def _save_then_continue(ckpt, layout):
    """Train 2 steps, save model + optimizer, return the next 2 losses."""
    from megatron.core import dist_checkpointing
    model, opt = _build(**layout)
    for it in range(2):
        train_step(model, opt, global_batch(it))
    dist_checkpointing.save(_sharded(model, opt), ckpt)
    expected = [train_step(model, opt, global_batch(it))[0] for it in (2, 3)]
    ps.destroy_model_parallel()
    return expected


def _load_and_continue(ckpt, layout):
    from megatron.core import dist_checkpointing
    model, opt = _build(**layout)
    loaded = dist_checkpointing.load(_sharded(model, opt, is_loading=True), ckpt)
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    losses = [train_step(model, opt, global_batch(it))[0] for it in (2, 3)]
    ps.destroy_model_parallel()
    return losses


def _reshard_cases(base):
    out = {}
    for name, save, load in (("tp2_to_pp2", dict(tp=2), dict(pattern="M*G|-", pp=2)),
                             ("pp2_to_tp2_distopt", dict(pattern="M*G|-", pp=2), dict(tp=2, distopt=True))):
        out[name] = (_save_then_continue(f"{base}/{name}", save), _load_and_continue(f"{base}/{name}", load))
    return out


def _load_on_one_rank(base):
    return {name: _load_and_continue(f"{base}/{name}", {}) for name in ("tp2_to_pp2", "pp2_to_tp2_distopt")}


def test_checkpoint_reshards_across_tp_and_pp(tmp_path):
    from megatron.core.dist_checkpointing.serialization import tensor_shapes
    results = run_distributed(_reshard_cases, 2, str(tmp_path))
    for rank_results in results:
        for name, (expected, got) in rank_results.items():
            _close(name, got, expected)
    keys = set(tensor_shapes(str(tmp_path / "tp2_to_pp2")))
    # Megatron's keys: the fused in_proj and conv saved one part per tensor, the norm under its TE name.
    assert {"decoder.layers.0.mixer.in_proj.weight.z", "decoder.layers.0.mixer.in_proj.weight.dt",
            "decoder.layers.0.mixer.conv1d.weight.B", "decoder.layers.0.mixer.in_proj.layer_norm_weight",
            "decoder.layers.2.self_attention.in_proj.weight.alpha", "decoder.final_norm.weight"} <= keys
    for name, got in run_distributed(_load_on_one_rank, 1, str(tmp_path))[0].items():
        _close(f"{name}->one rank", got, results[0][name][0])


def _mtp_references():
    model, _ = _build(MTP_PATTERN)
    names = [n for n, _ in model.module.named_parameters() if n.startswith("mtp.")]
    ps.destroy_model_parallel()
    return {"with_mtp": _losses(dict(pattern=MTP_PATTERN)), "without": _losses({}), "names": names}


def _mtp_two_rank_layouts(base):
    out = {"tp2_sp": _losses(dict(pattern=MTP_PATTERN, tp=2, sp=True)),
           "dp2_distopt": _losses(dict(pattern=MTP_PATTERN, distopt=True))}
    out["ckpt"] = _save_then_continue(f"{base}/mtp_tp2", dict(pattern=MTP_PATTERN, tp=2))
    return out


def test_mtp_depths_equal_one_process_and_reshard(tmp_path):
    ref = run_distributed(_mtp_references, 1)[0]
    assert "mtp.layers.1.mtp_model_layer.layers.0.mixer.in_proj.weight" in ref["names"]  # Megatron's key names
    # The MTP losses only add gradients: the first step's reported loss is the same, later ones differ.
    assert ref["with_mtp"][0] == ref["without"][0] and ref["with_mtp"][1:] != ref["without"][1:]
    results = run_distributed(_mtp_two_rank_layouts, 2, str(tmp_path))
    for name in ("tp2_sp", "dp2_distopt"):
        _close(f"mtp {name}", results[0][name], ref["with_mtp"])
    resumed = run_distributed(_load_and_continue, 1, f"{tmp_path}/mtp_tp2", dict(pattern=MTP_PATTERN))[0]
    _close("mtp tp2 -> one rank", resumed, results[0]["ckpt"])


MLA_PATTERN = "M+-*"


def _mla_two_ranks():
    return _losses(dict(pattern=MLA_PATTERN, tp=2, sp=True))


def test_mla_layers_equal_one_process():
    ref = run_distributed(_losses, 1, dict(pattern=MLA_PATTERN))[0]
    assert ref[-1] < ref[0]
    for losses in run_distributed(_mla_two_ranks, 2):
        _close("mla tp2_sp", losses, ref)


def test_mamba_tp2_cp2_equal_one_process():
    """4 ranks: TP=2 (+SP) x CP=2 over Mamba-2, attention and MLP layers, 4 groups (1 per TP x CP rank)."""
    ref = run_distributed(_losses, 1, dict(pattern=CP_MAMBA, groups=4))[0]
    for losses in run_distributed(_losses, 4, dict(pattern=CP_MAMBA, groups=4, tp=2, cp=2, sp=True)):
        _close("mamba tp2 x cp2", losses, ref)

"""Multi-latent attention (YaRN, q and kv low-rank) trains the same under TP=2 + SP, PP=2 x TP=2 and PP=2
with the distributed optimizer as in one process; MTP the same under TP=2 + SP. Compared: the loss per
iteration and every weight's norm after the last step (SGD, so gradient errors reach the weights as is).

One spawned world of 4 ranks runs the three layouts one after the other; one single-process world gives
the references. fp32 and dropout 0, so the layouts differ only in summation order (all-reduces, split
GEMMs): 1e-5 relative per iteration on losses of ~4 leaves a wide margin over that noise (~1e-7).
"""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.initialize import global_param_names
from megatron.core.transformer.transformer_config import MLATransformerConfig
from tests.fixtures import tiny_gpt
from tests.parallel.dist_utils import run_distributed

ITERS = 3
RTOL = 1e-5


def _config(tp, pp, sp, mtp):
    return tiny_gpt.tiny_config(
        MLATransformerConfig, ffn_hidden_size=64,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
        params_dtype=torch.float32, add_bias_linear=False,
        qk_layernorm=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
        rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
        original_max_position_embeddings=8, mtp_num_layers=1 if mtp else None)


def _build(tp=1, pp=1, sp=False, distopt=False, mtp=False):
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(1234)
    cfg = _config(tp, pp, sp, mtp)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    gpt = tiny_gpt.tiny_gpt(cfg, spec=spec, position_embedding_type="rope",
                            mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec))
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=distopt,
                                                                       bucket_size=4000), gpt)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=1.0, weight_decay=0.01, clip_grad=1.0,
                                                 use_distributed_optimizer=distopt), [model])
    return model, opt


def _train(tp=1, pp=1, sp=False, distopt=False, mtp=False):
    """ITERS steps on layout-independent global batches; per-step mean LM loss and MTP loss."""
    model, opt = _build(tp, pp, sp, distopt, mtp)
    initial = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    mtp_sums = []

    def forward_step(data_iterator, model):
        out, loss_func = tiny_gpt.forward_step(data_iterator, model)
        stats = model.module.mtp_loss_stats
        if stats is not None and ps.get_tensor_model_parallel_rank() == 0:
            mtp_sums.append(stats[0])
        return out, loss_func

    losses, mtp_losses = [], []
    for it in range(ITERS):
        mtp_sums.clear()
        loss, _ = tiny_gpt.train_step(model, opt, tiny_gpt.global_batch(it), forward_step_func=forward_step)
        mtp_total = sum(mtp_sums, torch.zeros(2)).double()
        torch.distributed.all_reduce(mtp_total)
        losses.append(loss)
        mtp_losses.append((mtp_total[0] / mtp_total[1]).item() if mtp else None)
    norms = _param_norms(model.module, initial)
    ps.destroy_model_parallel()
    return losses, mtp_losses, norms


def _param_norms(gpt, initial):
    """{global parameter name: (squared norm of the weight, of its total update)}, each element counted
    once: a loss hides small gradient errors (a norm's grad reduced twice), the SGD updates do not."""
    names, local = global_param_names(gpt), {}
    if ps.get_data_parallel_rank() == 0:
        for name, p in gpt.named_parameters():
            replica = not getattr(p, "tensor_model_parallel", False) and ps.get_tensor_model_parallel_rank() != 0
            tied_copy = getattr(p, "shared_embedding", False) and not ps.is_pipeline_first_stage()
            if not (replica or tied_copy):
                w, dw = p.detach().double(), (p.detach() - initial[name]).double()
                old = local.get(names[name], (0.0, 0.0))
                local[names[name]] = (old[0] + w.pow(2).sum().item(), old[1] + dw.pow(2).sum().item())
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    out = {}
    for part in gathered:
        for name, (w, dw) in part.items():
            old = out.get(name, (0.0, 0.0))
            out[name] = (old[0] + w, old[1] + dw)
    return out


LAYOUTS = {"tp2_sp_mtp": dict(tp=2, sp=True, mtp=True), "pp2_tp2": dict(tp=2, pp=2),
           "pp2_distopt": dict(pp=2, distopt=True)}


def _layouts():
    return {name: _train(**layout) for name, layout in LAYOUTS.items()}


def _references():
    return {"plain": _train(), "mtp": _train(mtp=True)}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_references, 1)[0], run_distributed(_layouts, 4)


def _close(a, b):
    assert len(a) == len(b) == ITERS
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= RTOL * abs(y), f"iteration {i + 1}: {x} vs {y}"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_mla_layout_matches_single_process(runs, name):
    refs, per_rank = runs
    ref = refs["mtp" if LAYOUTS[name].get("mtp") else "plain"]
    for rank_result in per_rank:
        _close(rank_result[name][0], ref[0])
    if LAYOUTS[name].get("mtp"):
        _close(per_rank[0][name][1], ref[1])
    got, want = per_rank[0][name][2], ref[2]
    assert got.keys() == want.keys()
    for key in want:
        (w, dw), (w_ref, dw_ref) = got[key], want[key]
        assert abs(w - w_ref) <= RTOL * w_ref, f"{key}: {w} vs {w_ref}"
        # An update is a difference of O(1) weights, so fp32 leaves it ~1e-5 relative noise; a gradient
        # reduced twice (or not at all) moves it by 100%.
        assert abs(dw - dw_ref) <= 1e-3 * dw_ref + 1e-12, f"{key} update: {dw} vs {dw_ref}"


def test_mtp_changes_the_updates(runs):
    refs, _ = runs
    plain, mtp = refs["plain"][0], refs["mtp"][0]
    assert plain[0] == pytest.approx(mtp[0], rel=1e-6)  # same init, same first forward
    assert abs(plain[-1] - mtp[-1]) > 1e-6  # the MTP loss reached the shared weights

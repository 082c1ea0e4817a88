"""GPT loss-curve invariance under pipeline layouts (PP, virtual stages with p2p overlapped and synchronous,
uneven split, custom layouts, TP x PP with SP, PP x DP): 10 Adam steps on fixed data must give the TP=PP=DP=1
loss at every iteration.

fp32 on CPU with dropout 0: layouts differ only in summation order (TP partial sums, DP grad
averaging), which stays far below 1e-5 relative over 10 steps of a tiny model.
"""
import functools

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.fixtures.tiny_gpt import (
    MBS,
    SEQ,
    forward_step,
    global_batch,
    loss_per_token,
    tiny_config,
    tiny_gpt,
    train_step,
)
from tests.parallel.dist_utils import run_distributed

ITERS, LAYERS = 10, 8


def _config(tp=1, pp=1, vp=None, sp=False, first=None, last=None, overlap_p2p=False, layout=None):
    # overlap_p2p: the interleaved schedule's p2p overlapped in every phase, with the sent outputs freed
    # (deallocate_pipeline_outputs) as pretrain_gpt.py's config does.
    p2p = dict(overlap_p2p_comm=True, batch_p2p_comm=False, overlap_p2p_comm_warmup_flush=True,
               deallocate_pipeline_outputs=True) if overlap_p2p else {}
    return tiny_config(
        num_layers=LAYERS, ffn_hidden_size=64, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
        sequence_parallel=sp, num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last, pipeline_model_parallel_layout=layout, seed=1234, **p2p)


def _build(config, vp):
    return [tiny_gpt(config, vp_stage=stage if vp else None) for stage in range(vp or 1)]


def _reduce_grads(chunks):
    """Stand-in for DDP + finalize_model_grads: average over DP, sum SP-partial grads over TP and
    the tied embedding grads over the embedding group (first and last stage)."""
    dp = parallel_state.get_data_parallel_world_size()
    for chunk in chunks:
        for p in chunk.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if dp > 1:
                torch.distributed.all_reduce(p.grad, group=parallel_state.get_data_parallel_group())
                p.grad /= dp
            if getattr(p, "sequence_parallel", False) and \
                    parallel_state.get_tensor_model_parallel_world_size() > 1:
                torch.distributed.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
            if getattr(p, "shared_embedding", False) and \
                    parallel_state.get_pipeline_model_parallel_world_size() > 1:
                torch.distributed.all_reduce(p.grad, group=parallel_state.get_embedding_group())


def _train(layout):
    tp, pp, vp = layout.get("tp", 1), layout.get("pp", 1), layout.get("vp")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = _config(tp, pp, vp, layout.get("sp", False), layout.get("first"), layout.get("last"),
                     layout.get("overlap_p2p", False), layout.get("layout"))
    chunks = _build(config, vp)
    opt = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=1e-3)
    losses = [train_step(chunks, opt, global_batch(it, seed=0), finalize=_reduce_grads)[0] for it in range(ITERS)]
    with torch.no_grad():
        val = get_forward_backward_func()(
            forward_step_func=forward_step, model=chunks, forward_only=True,
            data_iterator=[iter(global_batch(0, seed=1000)) for _ in chunks],
            num_microbatches=len(global_batch(0)), seq_length=SEQ, micro_batch_size=MBS)
    losses.append(loss_per_token(val))
    tied = [c.shared_embedding_or_output_weight().detach().clone() for c in chunks
            if c.pre_process or c.post_process]
    return {"losses": losses, "tied": tied, "tp_rank": parallel_state.get_tensor_model_parallel_rank()}


def _train_layouts(layouts):
    out = []
    for layout in layouts:
        out.append(_train(layout))
        parallel_state.destroy_model_parallel()
    return out


def _check(results_by_rank, reference):
    """Every rank's loss (reduced over all ranks) equals the reference; tied weights equal on first and last
    stage."""
    for layout_idx in range(len(results_by_rank[0])):
        per_rank = [r[layout_idx] for r in results_by_rank]
        reported = [r["losses"] for r in per_rank if r["losses"][0] is not None]
        assert reported, "no rank reported a loss"
        for losses in reported:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5,
                                       atol=0, msg=lambda m: f"layout {layout_idx}: {m}")
        by_tp = {}
        for r in per_rank:
            for w in r["tied"]:
                by_tp.setdefault(r["tp_rank"], []).append(w)
        for ws in by_tp.values():
            for w in ws[1:]:
                torch.testing.assert_close(w, ws[0], rtol=0, atol=0)


@functools.lru_cache(maxsize=1)
def _reference():
    return run_distributed(_train_layouts, 1, [{}])[0][0]["losses"]


def test_two_rank_pipelines():
    reference = _reference()
    layouts = [{"pp": 2}, {"pp": 2, "vp": 2, "overlap_p2p": True}, {"pp": 2, "first": 3, "last": 5},
               # --pipeline-model-parallel-layout: uneven; interleaved with a stage holding only the embedding
               {"pp": 2, "layout": "Et*5|t*3L"}, {"pp": 2, "vp": 2, "layout": "E|t*3|t*4|tL"}]
    _check(run_distributed(_train_layouts, 2, layouts), reference)


def test_four_rank_pipelines():
    reference = _reference()
    layouts = [{"pp": 4}, {"pp": 4, "first": 1, "last": 1}, {"tp": 2, "pp": 2, "sp": True},
               {"pp": 2, "vp": 2}]  # the last runs as PP=2 (2 virtual stages) x DP=2
    _check(run_distributed(_train_layouts, 4, layouts), reference)

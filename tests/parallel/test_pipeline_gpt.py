"""GPT loss-curve invariance under pipeline layouts (PP, virtual stages, uneven split, TP x PP with SP,
PP x DP): 10 Adam steps on fixed data must give the TP=PP=DP=1 loss at every iteration.

fp32 on CPU with dropout 0: layouts differ only in summation order (TP partial sums, DP grad
averaging), which stays far below 1e-5 relative over 10 steps of a tiny model.
"""
import functools

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.parallel.dist_utils import run_distributed

SEQ, MBS, VOCAB, GBS, ITERS, LAYERS = 16, 2, 64, 8, 10, 8


def _config(tp=1, pp=1, vp=None, sp=False, first=None, last=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
        sequence_parallel=sp, num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last, params_dtype=torch.float32, seed=1234)


def _build(config, vp):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    chunks = []
    for stage in range(vp or 1):
        vp_stage = stage if vp else None
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
            max_sequence_length=SEQ, share_embeddings_and_output_weights=True, vp_stage=vp_stage,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)))
    return chunks


def _global_batch(iteration, split):
    """Micro-batches of this DP rank for one iteration (the global batch is layout-independent)."""
    g = torch.Generator().manual_seed(1000 * split + iteration)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    tokens = torch.randint(0, VOCAB, (GBS, SEQ + 1), generator=g)
    mine = tokens.view(GBS // (MBS * dp), dp, MBS, SEQ + 1)[:, dp_rank]  # [mb, b, s+1]
    return [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in mine]


def forward_step_func(data_iterator, model):
    batch = next(data_iterator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5  # True = masked (causal)
    out = model(batch["tokens"], position_ids, mask, labels=batch["labels"])

    def loss_func(output):
        loss = output.float().sum()
        n = torch.tensor(output.numel(), dtype=torch.int)
        return loss, n, {"lm loss": torch.stack([loss.detach(), n.float()])}

    return out, loss_func


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


def _mean_loss(dicts):
    if not dicts:
        return None
    total = torch.stack([d["lm loss"] for d in dicts]).sum(0)
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return (total[0] / total[1]).item()


def _train(layout):
    tp, pp, vp = layout.get("tp", 1), layout.get("pp", 1), layout.get("vp")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = _config(tp, pp, vp, layout.get("sp", False), layout.get("first"), layout.get("last"))
    chunks = _build(config, vp)
    opt = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=1e-3)
    schedule = get_forward_backward_func()
    num_mb = GBS // (MBS * parallel_state.get_data_parallel_world_size())
    losses = []
    for it in range(ITERS):
        opt.zero_grad(set_to_none=False)
        batches = _global_batch(it, 0)
        dicts = schedule(forward_step_func=forward_step_func,
                         data_iterator=[iter(batches) for _ in chunks], model=chunks,
                         num_microbatches=num_mb, seq_length=SEQ, micro_batch_size=MBS)
        _reduce_grads(chunks)
        opt.step()
        losses.append(_mean_loss(dicts))
    with torch.no_grad():
        val = schedule(forward_step_func=forward_step_func, model=chunks, forward_only=True,
                       data_iterator=[iter(_global_batch(0, 1)) for _ in chunks],
                       num_microbatches=num_mb, seq_length=SEQ, micro_batch_size=MBS)
    losses.append(_mean_loss(val))
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
    """Last-stage losses equal the reference; tied weights equal on first and last stage."""
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
    layouts = [{"pp": 2}, {"pp": 2, "vp": 2}, {"pp": 2, "first": 3, "last": 5}]
    _check(run_distributed(_train_layouts, 2, layouts), reference)


def test_four_rank_pipelines():
    reference = _reference()
    layouts = [{"pp": 4}, {"pp": 4, "first": 1, "last": 1}, {"tp": 2, "pp": 2, "sp": True},
               {"pp": 2, "vp": 2}]  # the last runs as PP=2 (2 virtual stages) x DP=2
    _check(run_distributed(_train_layouts, 4, layouts), reference)

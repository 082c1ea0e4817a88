"""Models on explicit process groups: one 4-rank gloo world split into the sub-groups {0, 1} and {2, 3}; each
pair trains its own tiny GPT (its own seed and data) on a ProcessGroupCollection of that pair, through DDP,
finalize_model_grads and the schedules, and must match the single-process run of the same model on
parallel_state's default groups (fp32, dropout 0, 1e-5 relative: the layouts only reorder fp32 sums).

parallel_state itself is initialised with TP=4 over the whole world, a layout neither pair uses: a module
that fell back to the registry would mix the two pairs' activations (or mis-shape its weights) and miss
its reference. Layouts on each pair: TP=2 + SP; PP=2 with tied embeddings (1F1B); CP=2 (DDP over DP x CP);
MoE with TP=2 x EP=2 (expert-TP 1); MoE with EP=2 x DP=2 (DDP over the explicit DP group).
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.parallel.dist_utils import run_distributed

ITERS, BATCH, MICRO, SEQ, VOCAB = 4, 4, 2, 16, 128
SEEDS = (1234, 4321)  # pair {0, 1}, pair {2, 3}

# layout -> (architecture, config sizes, {collection field: "pair" | "self"}); fields left out stay unset.
LAYOUTS = {
    "tp2_sp": ("dense", dict(tensor_model_parallel_size=2, sequence_parallel=True),
               dict(tp="pair", cp="self", pp="self", dp="self", dp_cp="self")),
    "pp2_tied": ("dense", dict(pipeline_model_parallel_size=2),
                 dict(tp="self", cp="self", pp="pair", embd="pair", dp="self", dp_cp="self")),
    "cp2": ("dense", dict(context_parallel_size=2),
            dict(tp="self", cp="pair", pp="self", dp="self", dp_cp="pair")),
    "moe_tp2_ep2": ("moe", dict(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                expert_tensor_parallel_size=1),
                    dict(tp="pair", cp="self", pp="self", dp="self", dp_cp="self", ep="pair", expt_tp="self",
                         tp_ep="pair", expt_dp="self", tp_dp_cp="pair")),
    "moe_ep2_dp2": ("moe", dict(expert_model_parallel_size=2),
                    dict(tp="self", cp="self", pp="self", dp="pair", dp_cp="pair", ep="pair", expt_tp="self",
                         tp_ep="pair", expt_dp="self", tp_dp_cp="pair")),
}


def _config(arch, seed, **sizes):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=1e-2,
               moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=32) if arch == "moe" else {}
    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                             ffn_hidden_size=96, normalization="RMSNorm", gated_linear_unit=True,
                             activation_func=F.silu, add_bias_linear=False, qk_layernorm=True, hidden_dropout=0.0,
                             attention_dropout=0.0, seed=seed, **moe, **sizes)


def _model(config, pg_collection, pp_rank=0, pp_size=1):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=True)
    return GPTModel(config, spec, VOCAB, SEQ, position_embedding_type="rope", share_embeddings_and_output_weights=True,
                    pre_process=pp_rank == 0, post_process=pp_rank == pp_size - 1, pg_collection=pg_collection)


def _micro_batches(seed, dp_rank, dp_size, cp_rank, cp_size):
    """Per iteration, this DP rank's share of the global batch as micro-batches of MICRO samples (the
    same micro-batches as the single-process run, so per-micro-batch MoE losses match too), each cut to
    this CP rank's part of the sequence."""
    from megatron.core.context_parallel.utils import get_batch_on_this_cp_rank

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(ITERS):
        # Ids from an eighth of the vocabulary: a model learns that within a few steps (it shows it trains).
        tokens = torch.randint(0, VOCAB // 8, (BATCH, SEQ + 1), generator=gen)
        mine = tokens.chunk(dp_size)[dp_rank]
        out.append([get_batch_on_this_cp_rank({"tokens": t[:, :-1], "labels": t[:, 1:],
                                               "position_ids": torch.arange(SEQ).expand(t.size(0), SEQ)},
                                              cp_size, cp_rank) for t in mine.split(MICRO)])
    return out


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(per_token_loss):
        # (sum, tokens): the schedule divides by the tokens over CP, so CP ranks share one mean.
        total, count = per_token_loss.sum(), torch.tensor(per_token_loss.numel())
        return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}

    return out, loss_func


def _train(arch, seed, sizes, pg_collection=None):
    """ITERS Adam steps through DDP + the schedule; per-iteration lm loss, the mean over the tokens of all
    DP and CP ranks (None on pipeline stages without the loss)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import get_pg, get_pg_rank, get_pg_size
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    config = _config(arch, seed, **sizes)
    # The RNG streams of this rank's coordinates in its own groups (dense layouts have no expert groups).
    ranks = {name: get_pg_rank(pg_collection, name) if pg_collection is None or getattr(pg_collection, name)
             else 0 for name in ("tp", "ep", "expt_tp")}
    model_parallel_cuda_manual_seed(seed, tp_rank=ranks["tp"], ep_rank=ranks["ep"], etp_rank=ranks["expt_tp"])
    pp_rank, pp_size = get_pg_rank(pg_collection, "pp"), get_pg_size(pg_collection, "pp")
    model = _model(config, pg_collection, pp_rank, pp_size)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model, pg_collection=pg_collection)
    ddp.broadcast_params()
    config.finalize_model_grads_func = finalize_model_grads
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    coords = [get_pg_rank(pg_collection, name) for name in ("dp", "cp")]
    sizes = [get_pg_size(pg_collection, name) for name in ("dp", "cp")]
    schedule = get_forward_backward_func(schedule_pg_collection=pg_collection)
    losses = []
    for micro in _micro_batches(seed, coords[0], sizes[0], coords[1], sizes[1]):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        stats = schedule(forward_step_func=_forward_step, data_iterator=iter(micro), model=[ddp],
                         num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=MICRO,
                         pg_collection=pg_collection)
        for p in ddp.parameters():
            p.grad = p.main_grad
        opt.step()
        if pp_rank == pp_size - 1:
            total = torch.stack([s["lm loss"] for s in stats]).sum(dim=0)  # [loss sum, tokens]
            if sizes[0] * sizes[1] > 1:
                dist.all_reduce(total, group=get_pg(pg_collection, "dp_cp"))
            losses.append((total[0] / total[1]).item())
    return losses or None


def _references():
    """Every (architecture, seed) on one process and parallel_state's (trivial) default groups."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    return {(arch, seed): _train(arch, seed, {}) for arch in ("dense", "moe") for seed in SEEDS}


def _collection(fields):
    """This rank's ProcessGroupCollection: "pair" fields get its pair's group, "self" ones a one-rank group.
    Every rank creates every group, in the same order (torch.distributed.new_group is collective)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    groups = {"pair": pairs[rank // 2], "self": singles[rank]}
    return ProcessGroupCollection(**{name: groups[kind] for name, kind in fields.items()})


def _explicit_layouts():
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=4)  # the registry's groups: used by none below
    seed = SEEDS[dist.get_rank() // 2]
    return {name: _train(arch, seed, sizes, _collection(fields)) for name, (arch, sizes, fields) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_references, 1)[0], run_distributed(_explicit_layouts, 4, timeout=600)


def _close(got, ref, rel=1e-5):
    assert len(got) == len(ref) == ITERS
    for i, (x, y) in enumerate(zip(got, ref)):
        assert abs(x - y) <= rel * abs(y), f"iteration {i + 1}: {x} vs {y}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_pair_matches_its_own_reference(runs, name):
    references, per_rank = runs
    arch = LAYOUTS[name][0]
    assert references[(arch, SEEDS[0])] != references[(arch, SEEDS[1])]  # the pairs really train apart
    for rank, results in enumerate(per_rank):
        if results[name] is not None:  # pipeline stages without the loss report None
            _close(results[name], references[(arch, SEEDS[rank // 2])])
    assert sum(r[name] is not None for r in per_rank) == (2 if name == "pp2_tied" else 4)


def test_references_train(runs):
    references, _ = runs
    for losses in references.values():
        assert losses[-1] < losses[0]


def _refusals():
    """The one-line errors of a collection that does not fit the model, and of what cannot honour one."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import process_group_kwargs

    one = dist.new_group([0])
    errors = {}

    def error(key, fn):
        try:
            fn()
        except (ValueError, NotImplementedError) as e:
            errors[key] = str(e)

    full = dict(tp=one, cp=one, pp=one, dp_cp=one)
    error("no_cp", lambda: _model(_config("dense", 1), ProcessGroupCollection(tp=one, pp=one)))
    error("tp_size", lambda: _model(_config("dense", 1, tensor_model_parallel_size=2),
                                    ProcessGroupCollection(**full)))
    error("no_dp", lambda: DistributedDataParallel(_config("dense", 1), DistributedDataParallelConfig(),
                                                   torch.nn.Linear(2, 2), pg_collection=ProcessGroupCollection(tp=one)))
    ddp = DistributedDataParallel(_config("dense", 1), DistributedDataParallelConfig(),
                                  _model(_config("dense", 1), ProcessGroupCollection(**full)),
                                  pg_collection=ProcessGroupCollection(**full))
    error("optimizer", lambda: get_megatron_optimizer(OptimizerConfig(lr=1e-3), [ddp]))
    error("no_groups_kwarg", lambda: process_group_kwargs(torch.nn.LayerNorm, ProcessGroupCollection(**full),
                                                          "TransformerLayer"))
    return errors


def test_a_collection_that_does_not_fit_is_named_in_one_line():
    errors = run_distributed(_refusals, 1)[0]
    assert "'cp' group" in errors["no_cp"]
    assert "'tp' group" in errors["tp_size"] and "tensor_model_parallel_size is 2" in errors["tp_size"]
    assert "'dp_cp' group" in errors["no_dp"]
    assert "explicit pg_collection" in errors["optimizer"]
    assert "LayerNorm takes neither" in errors["no_groups_kwarg"]
    assert all("\n" not in message for message in errors.values())

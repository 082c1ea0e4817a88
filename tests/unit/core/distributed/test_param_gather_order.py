"""After the optimizer step the distributed optimizer all-gathers the updated params bucket by bucket, and the
all-gathers complete in launch order. Buckets hold params in backward order (the output layer's in the first,
the embedding's in the last), so they are launched in the forward's order: the first layers' params arrive
first and the next forward starts while the rest still travel, instead of waiting for every bucket."""
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, param_and_grad_buffer
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from tests.fixtures.tiny_gpt import single_rank, tiny_config, tiny_gpt


def _model():
    single_rank()
    torch.manual_seed(0)
    config = tiny_config(hidden_size=32, num_layers=4)
    model = tiny_gpt(config, vocab_size=64)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        num_buckets=5, overlap_grad_reduce=True, overlap_param_gather=True, use_distributed_optimizer=True), model)
    return config, ddp, model


def _launches(monkeypatch):
    """The first model position (index in module.parameters()) of each bucket whose all-gather starts."""
    launched = []
    real = param_and_grad_buffer._ParamAndGradBucket.start_param_sync

    def start(bucket, async_op):
        launched.append(bucket)
        return real(bucket, async_op)
    monkeypatch.setattr(param_and_grad_buffer._ParamAndGradBucket, "start_param_sync", start)
    return launched


def test_all_gathers_launch_in_the_forward_order(monkeypatch):
    config, ddp, model = _model()
    position = {p: i for i, p in enumerate(model.parameters())}
    buckets = [b for buffer in ddp.buffers for b in buffer.buckets]
    assert len(buckets) >= 3
    # the layout this order answers: the embedding (the forward's first param) lives in the last bucket
    assert position[min(buckets[-1].params, key=position.get)] == 0
    launched = _launches(monkeypatch)
    ddp.start_param_sync()
    ddp.finish_param_sync()
    firsts = [min(position[p] for p in b.params) for b in launched]
    assert len(launched) == len(buckets) and firsts[0] == 0 and firsts == sorted(firsts)


def test_the_optimizer_step_launches_them_in_that_order(monkeypatch):
    config, ddp, model = _model()
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True,
                                                       bf16=False), [ddp])
    position = {p: i for i, p in enumerate(model.parameters())}
    for p in model.parameters():
        p.main_grad.add_(0.01)
    launched = _launches(monkeypatch)
    optimizer.step()
    ddp.finish_param_sync()
    firsts = [min(position[p] for p in b.params) for b in launched]
    assert firsts and firsts[0] == 0 and firsts == sorted(firsts)



def test_an_optimizer_of_some_buffers_launches_its_own_in_that_order(monkeypatch):
    """An optimizer that owns only some buffers (Muon's layer-wise buffers beside AdamW's) all-gathers only its own
    buffers' buckets: those too start from the forward's end of the buffer."""
    single_rank()
    torch.manual_seed(0)
    config = tiny_config(hidden_size=32, num_layers=4, num_moe_experts=4, moe_router_topk=2, add_bias_linear=False)
    model = tiny_gpt(config, vocab_size=64, spec=get_gpt_layer_local_spec(num_experts=4))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        num_buckets=5, overlap_grad_reduce=True, overlap_param_gather=True, use_distributed_optimizer=True), model)
    dense = [p for buffer in ddp.buffers for p in buffer.params]
    optimizer = DistributedOptimizer(torch.optim.AdamW(dense, lr=1e-3),
                                     OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), None,
                                     model_chunks=[ddp], per_model_buffers={0: ddp.buffers})
    assert ddp.expert_parallel_buffers and not optimizer._owns_all_buffers
    position = {p: i for i, p in enumerate(model.parameters())}
    for p in dense:
        p.main_grad.add_(0.01)
    launched = _launches(monkeypatch)
    optimizer.step()
    ddp.finish_param_sync()
    dense_buckets = [b for buffer in ddp.buffers for b in buffer.buckets]
    assert len(launched) == len(dense_buckets) > 1
    firsts = [min(position[p] for p in b.params) for b in launched]
    assert firsts == sorted(firsts), firsts

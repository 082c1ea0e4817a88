"""--cpu-offloading-num-layers: the first N layers' saved tensors go to host memory in the forward and come back in
the backward (autograd's saved-tensor hooks); the layers' parameters stay. The losses and every gradient equal the
run without offloading exactly (the same values, only moved), the offloaded layers moved tensors and the others
none, and evaluation moves nothing."""
import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import activation_offload
from tests.fixtures.tiny_gpt import VOCAB, single_rank, tiny_config


def _run(offload: int, monkeypatch):
    single_rank()
    model_parallel_cuda_manual_seed(9)
    model = GPTModel(tiny_config(num_layers=3, cpu_offloading_num_layers=offload), get_gpt_layer_local_spec(),
                     VOCAB, 64)
    contexts = []
    real = activation_offload.ActivationOffload

    def recording(keep):
        contexts.append(real(keep))
        return contexts[-1]
    monkeypatch.setattr("megatron.core.transformer.transformer_block.ActivationOffload", recording)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).unsqueeze(0).expand(2, -1)
    loss = model(ids, pos, None).float().square().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        model(ids, pos, None)
    return loss.item(), grads, contexts


def test_offloaded_layers_train_exactly_like_kept_ones(monkeypatch):
    loss, grads, none = _run(0, monkeypatch)
    off_loss, off_grads, contexts = _run(2, monkeypatch)
    assert not none and len(contexts) == 2  # layers 0 and 1, one forward each; none in evaluation
    assert all(c.moved > 0 for c in contexts)
    assert off_loss == loss
    for name, g in grads.items():
        assert torch.equal(off_grads[name], g), name


def test_offload_keeps_parameters_where_they_are():
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    with activation_offload.ActivationOffload(set()) as c:
        y = torch.nn.functional.linear(x, w).relu().sum()
    keep = activation_offload.ActivationOffload({w.untyped_storage().data_ptr()})
    with keep:
        z = torch.nn.functional.linear(x, w).relu().sum()
    assert keep.moved < c.moved  # the weight stayed
    y.backward()
    z.backward()


@pytest.mark.parametrize("kw,needle", [(dict(cpu_offloading_num_layers=3), "between 1 and --num-layers - 1"),
                                       (dict(cpu_offloading_num_layers=1, recompute_granularity="full",
                                             recompute_method="uniform", recompute_num_layers=1), "recompute")])
def test_offloading_refusals(kw, needle):
    with pytest.raises(ValueError, match=needle):
        tiny_config(num_layers=3, **kw)

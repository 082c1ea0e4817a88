"""The output layer's deferred weight gradient (--defer-embedding-wgrad-compute), one process, fp32: parked calls
pair each input with its own output gradient whatever order their backwards run in (the main head and the MTP
depths call the output layer once each), the drain adds exactly the plain linear's weight gradient into
main_grad (written first, then added), --wgrad-deferral-limit parks only the first calls, and autograd hands the
weight no gradient (its DDP hook skips it: delay_wgrad)."""
import pytest
import torch

from megatron.core.pipeline_parallel.deferred_output_wgrad import finish_deferred_output_wgrad
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.weight_grad import drain_embedding_wgrad_compute
from tests.fixtures.tiny_gpt import single_rank, tiny_config


def _layer(limit=0):
    single_rank()
    cfg = tiny_config(gradient_accumulation_fusion=True)
    cfg.wgrad_deferral_limit = limit
    torch.manual_seed(0)
    layer = ColumnParallelLinear(8, 6, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                 embedding_activation_buffer=[], grad_output_buffer=[])
    layer.weight.main_grad = torch.zeros_like(layer.weight)
    layer.weight.main_grad_fresh = True
    return layer


@pytest.mark.parametrize("limit", [0, 1])
def test_drain_adds_the_plain_weight_gradient_of_every_call(limit):
    layer = _layer(limit)
    xs = [torch.randn(5, 2, 8, requires_grad=True) for _ in range(3)]
    ws = [torch.randn(5, 2, 6) for _ in range(3)]
    outs = [layer(x)[0] for x in xs]
    assert len(layer.embedding_activation_buffer) == (limit or 3)
    for i in (2, 0, 1):  # backwards out of forward order
        (outs[i] * ws[i]).sum().backward()
    assert layer.weight.grad is None and layer.weight.delay_wgrad
    expected = sum(w.reshape(-1, 6).t() @ x.detach().reshape(-1, 8) for w, x in zip(ws, xs))
    drain_embedding_wgrad_compute(layer.config, layer.embedding_activation_buffer, layer.grad_output_buffer,
                                  layer.weight, None)
    assert not layer.embedding_activation_buffer and not layer.grad_output_buffer
    torch.testing.assert_close(layer.weight.main_grad, expected, rtol=1e-6, atol=1e-6)
    for x, w in zip(xs, ws):  # the input gradients are the plain linear's
        torch.testing.assert_close(x.grad, (w @ layer.weight).detach(), rtol=1e-6, atol=1e-6)


def test_a_parked_call_without_its_backward_is_named():
    layer = _layer()
    layer(torch.randn(3, 1, 8, requires_grad=True))
    with pytest.raises(RuntimeError, match="has no output gradient"):
        drain_embedding_wgrad_compute(layer.config, layer.embedding_activation_buffer, layer.grad_output_buffer,
                                      layer.weight, None)
    assert not layer.embedding_activation_buffer and not layer.grad_output_buffer


def test_no_grad_forward_parks_nothing():
    layer = _layer()
    with torch.no_grad():
        layer(torch.randn(3, 1, 8))
    assert layer.embedding_activation_buffer == [] and layer.grad_output_buffer == []


def test_finish_reports_the_weight_to_its_hook_once():
    layer = _layer()
    model = torch.nn.Module()
    model.output_layer, model.post_process, model.share_embeddings_and_output_weights = layer, True, False
    model.config = layer.config
    layer.config.defer_embedding_wgrad_compute = True
    seen = []
    layer.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
    (layer(torch.randn(4, 1, 8, requires_grad=True))[0].sum()).backward()
    assert seen == [False]  # autograd's call, with no gradient
    finish_deferred_output_wgrad(layer.config, [model])
    assert seen == [False, True] and layer.weight.grad is None and layer.weight.grad_added_to_main_grad


def test_a_forward_only_pass_with_autograd_on_leaves_nothing_for_the_next_step():
    """Megatron empties the buffers at the start of every schedule call: an evaluation run without no_grad (a
    Core API caller's forward_only=True) parks inputs whose backward never runs; the next step must not drain
    them (it raised 'has no output gradient')."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    layer = _layer()
    layer.config.defer_embedding_wgrad_compute = True
    model = torch.nn.Module()
    model.output_layer, model.post_process, model.share_embeddings_and_output_weights = layer, True, False
    model.config = layer.config
    model.set_input_tensor = lambda tensor: None
    x, w = torch.randn(4, 1, 8), torch.randn(4, 1, 6)

    def forward_step(data_iterator, model):
        out = model.output_layer(x.clone().requires_grad_())[0]
        return out, lambda o: ((o * w).sum(), {"loss": (o * w).sum().detach()})

    run = dict(forward_step_func=forward_step, data_iterator=None, model=[model], num_microbatches=1,
               seq_length=4, micro_batch_size=1)
    forward_backward_no_pipelining(**run, forward_only=True)
    assert layer.embedding_activation_buffer == [] and layer.grad_output_buffer == []
    layer.embedding_activation_buffer.append(x)  # and what a step that raised left behind
    layer.grad_output_buffer.append(None)
    forward_backward_no_pipelining(**run)
    torch.testing.assert_close(layer.weight.main_grad, w.reshape(-1, 6).t() @ x.reshape(-1, 8), rtol=1e-6, atol=1e-6)

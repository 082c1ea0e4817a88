"""Megatron's schedule helpers, one process: the schedule table, per-rank micro-batch counts, tensor
shapes, and forward_step with its token-weighted loss."""
import torch

from tests.fixtures.tiny_gpt import tiny_config


def _tiny_gpt_config():
    return tiny_config(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)


def test_schedule_helpers_and_forward_step():
    from megatron.core.pipeline_parallel import schedules as S
    assert S.get_schedule_table(5, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1),
                                            (4, 0), (4, 1)]
    assert S.get_pp_rank_microbatches(4, 1, 1) == (4, False, 0, 4)  # PP=1: no warm-up
    assert S.get_pp_rank_microbatches(4, 2, 1, forward_only=True) == (8, True, 8, 0)
    assert S.check_first_val_step(False, True, True) is False and S.check_first_val_step(None, True, True)
    assert S.get_tensor_device({"a": torch.zeros(1)}) == torch.device("cpu")
    cfg = _tiny_gpt_config()
    assert S.get_tensor_shapes(seq_length=8, micro_batch_size=2, decoder_seq_length=None, config=cfg) == [(8, 2, 16)]

    model = torch.nn.Linear(4, 1)
    model.config, model.set_input_tensor = cfg, lambda t: None
    data = [torch.randn(3, 4) for _ in range(2)]

    def step(it, m):
        out = m(next(it)).squeeze(-1)
        return out, lambda o: (o.pow(2).sum(), torch.tensor(3), {"lm loss": o.pow(2).mean().detach()})

    store = []
    out, n = S.forward_step(step, iter(data), model, 2, None, store, cfg, 1)
    # Token-weighted loss: divided by its token count and by the micro-batch count.
    torch.testing.assert_close(out, model(data[0]).pow(2).sum() / 3 / 2)
    assert int(n) == 3 and len(store) == 1
    out, n = S.forward_step_calc_loss(model, torch.ones(2), None, cfg, None, False, 2, store, 1, True)
    assert torch.equal(store[-1], torch.ones(2))  # no loss_func: the output itself is collected

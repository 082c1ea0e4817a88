"""--window-attn-skip-freq: which layers attend through --window-size (Megatron's reading: every N-th layer full,
or a 0/1 list per layer), the layers' attention built accordingly, and a model whose pattern windows every layer
(or none) equal to the model with the window everywhere (or nowhere)."""
import pytest
import torch

from megatron.core.transformer.window_attention import check_window_attn_skip_freq, is_layer_window_attention
from tests.fixtures.tiny_gpt import single_rank, tiny_config, tiny_gpt
from tests.unit.training.arguments.test_arguments import _args


def test_megatrons_reading():
    assert [is_layer_window_attention((3, 0), 2, n) for n in range(1, 5)] == [True, False, True, False]
    assert [is_layer_window_attention((3, 0), 4, n) for n in range(1, 5)] == [True, True, True, False]
    assert [is_layer_window_attention((3, 0), [0, 1, 1, 0], n) for n in range(1, 5)] == [False, True, True, False]
    assert all(is_layer_window_attention((3, 0), None, n) for n in range(1, 5))
    assert not is_layer_window_attention(None, 2, 1)


@pytest.mark.parametrize("window,freq,layers,message", [
    (None, 2, 4, "needs --window-size"),
    ((3, 0), 0, 4, "must be >= 1"),
    ((3, 0), [1, 0, 1], 4, "3 entries for 4 layers"),
    ((3, 0), [1, 2, 1, 0], 4, "list of 0/1"),
])
def test_bad_patterns_are_refused(window, freq, layers, message):
    with pytest.raises(ValueError, match=message):
        check_window_attn_skip_freq(window, freq, layers)


def _logits(**cfg):
    torch.manual_seed(0)
    model = tiny_gpt(tiny_config(num_layers=4, **cfg), position_embedding_type="rope").eval()
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        out = model(tokens, torch.arange(16).expand(2, 16), None)
    return model, out


def test_layers_follow_the_pattern():
    single_rank()
    model, mixed = _logits(window_size=(3, 0), window_attn_skip_freq=2)
    windows = [layer.self_attention.core_attention.window_size for layer in model.decoder.layers]
    assert windows == [(3, 0), None, (3, 0), None]
    _, everywhere = _logits(window_size=(3, 0))
    _, all_ones = _logits(window_size=(3, 0), window_attn_skip_freq=[1, 1, 1, 1])
    _, nowhere = _logits()
    _, all_zeros = _logits(window_size=(3, 0), window_attn_skip_freq=[0, 0, 0, 0])
    torch.testing.assert_close(all_ones, everywhere)
    torch.testing.assert_close(all_zeros, nowhere)
    assert not torch.allclose(mixed, everywhere) and not torch.allclose(mixed, nowhere)


def test_flag_parses_megatrons_forms_and_reaches_the_config():
    from megatron.training.arguments.configs import core_transformer_config_from_args
    args = _args("--window-size 3,0 --window-attn-skip-freq ([1]*1+[0]*1)*1")
    assert args.window_attn_skip_freq == [1, 0]
    assert core_transformer_config_from_args(args).window_attn_skip_freq == [1, 0]
    assert _args("--window-size 3,0 --window-attn-skip-freq 2").window_attn_skip_freq == 2

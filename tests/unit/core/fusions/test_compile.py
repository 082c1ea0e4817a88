"""maybe_compile runs the function eagerly on CPU."""
import torch

from megatron.core.fusions.compile import maybe_compile


def test_maybe_compile_is_eager_on_cpu():
    calls = []

    @maybe_compile
    def f(x):
        calls.append(1)
        return x * 2
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0)) and calls == [1]
    assert f.eager is not None

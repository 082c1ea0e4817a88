"""Generation through the SSM mixers: a prefill of right-padded prompts of different lengths, then decode steps
one token at a time from the per-slot conv and SSM states, equals running each full sequence (fp32; the only
difference is the chunked scan's summation order, ~1e-6 relative)."""
import pytest
import torch

from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.ssm.ops.recurrent_step import conv_state_after
from tests.fixtures.tiny_gpt import single_rank
from tests.unit.core.ssm.test_mixers import _mixer

LENGTHS = [7, 4]  # prompt length per row (row 1 right-padded during prefill)
STEPS = 5


@pytest.mark.parametrize("kind", ["mamba", "gdn"])
def test_prefill_then_decode_equals_the_full_sequence(kind):
    single_rank()
    torch.manual_seed(0)
    m = _mixer(kind).eval()
    m.layer_number = 1
    total = max(LENGTHS) + STEPS
    x = torch.randn(total, 2, 32)
    with torch.no_grad():
        full, _ = m(x)  # [s, b, h]
        ctx = StaticInferenceContext(max_batch_size=4, max_sequence_length=64)
        slots = torch.tensor([2, 0])  # not 0..b-1: prefill writes the slots it is given
        prompt = x[:max(LENGTHS)].clone()
        prompt[LENGTHS[1]:, 1] = 100.0  # padding that must not reach row 1's state
        ctx.set_prefill(slots, torch.tensor(LENGTHS) - 1)
        pre, _ = m(prompt, inference_context=ctx)
        for row, n in enumerate(LENGTHS):
            torch.testing.assert_close(pre[:n, row], full[:n, row], rtol=1e-5, atol=1e-5)
        # Decode runs slots 0..B-1: row r of the batch is slot r, so order the states accordingly.
        order = [1, None, 0]  # batch row b is slot b: slot 0 holds row 1, slot 1 is idle, slot 2 holds row 0
        for i in range(STEPS):
            ctx.set_decode(torch.tensor([LENGTHS[1] + i, 0, LENGTHS[0] + i]), kv_len=1)
            token = torch.stack([x[LENGTHS[1] + i, 1], torch.zeros(32), x[LENGTHS[0] + i, 0]])[None]  # [1, 3, h]
            out, _ = m(token, inference_context=ctx)
            for b, row in enumerate(order):
                if row is None:
                    continue  # an idle slot steps on garbage and nobody reads it
                torch.testing.assert_close(out[0, b], full[LENGTHS[row] + i, row], rtol=1e-5, atol=1e-5)


def test_conv_state_after_takes_each_rows_last_inputs():
    xbc = torch.arange(2 * 5 * 1, dtype=torch.float32).reshape(2, 5, 1)  # rows 0..4 and 5..9
    state = conv_state_after(xbc, torch.tensor([5, 2]), width=4)  # [b, c, 3]
    assert state[0, 0].tolist() == [2, 3, 4] and state[1, 0].tolist() == [0, 5, 6]  # zero before a short prompt

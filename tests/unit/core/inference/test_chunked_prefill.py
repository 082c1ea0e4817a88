"""--enable-chunked-prefill: a prompt longer than --inference-dynamic-batching-max-tokens is prefilled in chunks of at
most that many tokens, each attending to the slot's cached positions before it. The generated tokens, their
log-probs and the prompt's log-probs equal the unchunked engine's (fp32, CPU), with a sliding window too; models
whose recurrent layers would have to carry their state across chunks are refused in one line."""
import pytest
import torch

from megatron.core.inference import InferenceEngine, SamplingParams
from tests.unit.core.inference.test_cuda_graphs import MAX_LEN, _prompts, build_llama


def whole_and_chunked(model, prompts, params, chunk: int = 8):
    """The requests generated with the whole prompts prefilled, then with prompts over ``chunk`` tokens in chunks."""
    def run(chunked):
        engine = InferenceEngine(model, max_batch_size=4, max_sequence_length=MAX_LEN, max_prefill_tokens=chunk,
                                 chunked_prefill=chunked)
        return engine.generate(prompts, params)
    return run(False), run(True)


@pytest.mark.parametrize("window", [None, (12, 0)])
def test_chunked_prefill_equals_whole_prompt_prefill(window):
    model = build_llama(window=window)
    ps = _prompts([37, 5, 20], seed=4)
    params = [SamplingParams(top_k=1, num_tokens_to_generate=6, return_log_probs=True),
              SamplingParams(top_k=1, num_tokens_to_generate=6),
              SamplingParams(temperature=1.2, top_p=0.9, random_seed=5, num_tokens_to_generate=6)]

    whole, chunks = whole_and_chunked(model, ps, params)
    for a, b in zip(whole, chunks):
        assert a.generated_tokens == b.generated_tokens
        torch.testing.assert_close(torch.tensor(b.generated_log_probs), torch.tensor(a.generated_log_probs),
                                   rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(chunks[0].prompt_log_probs), torch.tensor(whole[0].prompt_log_probs),
                               rtol=0, atol=1e-5)
    assert len(chunks[0].prompt_log_probs) == 36


def test_chunked_prefill_refuses_recurrent_layers():
    from tests.unit.core.models.hybrid.test_hybrid_generation import build_tiny_hybrid
    with pytest.raises(NotImplementedError, match="--enable-chunked-prefill with Mamba-2 or Gated DeltaNet"):
        InferenceEngine(build_tiny_hybrid(), max_batch_size=2, max_sequence_length=64, chunked_prefill=True)

"""SamplingParams' token-count and termination fields (Megatron's names) in the generation engine,
one process."""

import pytest
import torch

from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt


def test_sampling_params_token_counts_and_termination_id():
    from megatron.core.inference import InferenceEngine, SamplingParams
    torch.manual_seed(0)
    config = tiny_config(num_layers=1, hidden_size=16, num_attention_heads=2)
    model = tiny_gpt(config, 32, 16, share_embeddings_and_output_weights=False).eval()
    engine = InferenceEngine(model, max_batch_size=2, max_sequence_length=16)
    prompt = [1, 2, 3, 4]
    until_full, total = engine.generate([prompt, prompt], [SamplingParams(top_k=1),
                                                         SamplingParams(top_k=1, num_tokens_total=7)])
    assert len(until_full.generated_tokens) == 12 and len(total.generated_tokens) == 3  # 16 - 4 and 7 - 4
    assert until_full.generated_tokens[:3] == total.generated_tokens  # greedy: the same continuation
    stop = until_full.generated_tokens[1]
    first = until_full.generated_tokens.index(stop)
    ended = engine.generate([prompt], SamplingParams(top_k=1, termination_id=stop))[0]
    assert ended.generated_tokens == until_full.generated_tokens[:first + 1] and ended.finish_reason == "stop"
    for bad in (dict(top_n_logprobs=2), dict(return_segments=True), dict(num_tokens_total=2)):
        with pytest.raises(ValueError):
            engine.check_request(len(prompt), SamplingParams(**bad))

"""Generation under TP=2 (gloo) equals TP=1: greedy tokens, log-probs within 1e-5, seeded samples.

Layout-independent init gives both layouts the same weights; they differ only in the order of the
split matmul sums and all-reduces (~1e-7 in fp32), far inside the 1e-5 log-prob tolerance.
"""
import torch

from tests.parallel.dist_utils import run_distributed
from tests.unit.test_inference_engine import MAX_LEN, build_tiny_gpt, prompts


def _generate(arch: str, tp: int):
    from megatron.core.inference import InferenceEngine, SamplingParams

    model = build_tiny_gpt(arch, tp=tp)
    ps = prompts([5, 9, 3, 6], seed=4)
    params = [SamplingParams(top_k=1, num_tokens_to_generate=8, return_log_probs=True)] * 3 + \
             [SamplingParams(temperature=1.3, top_p=0.95, random_seed=3, num_tokens_to_generate=8,
                             return_log_probs=True)]
    reqs = InferenceEngine(model, max_batch_size=4, max_sequence_length=MAX_LEN).generate(ps, params)
    return [(r.generated_tokens, r.generated_log_probs, r.prompt_log_probs) for r in reqs]


def _tp2_world():
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    return {arch: _generate(arch, tp=2) for arch in ("gpt2", "llama")}


def test_tp2_generation_equals_tp1():
    ranks = run_distributed(_tp2_world, 2)
    assert ranks[0] == ranks[1]  # both TP ranks agree on every token and number
    for arch in ("gpt2", "llama"):
        ref = _generate(arch, tp=1)
        for (tokens, lps, plps), (rtokens, rlps, rplps) in zip(ranks[0][arch], ref):
            assert tokens == rtokens
            torch.testing.assert_close(torch.tensor(lps), torch.tensor(rlps), rtol=0, atol=1e-5)
            torch.testing.assert_close(torch.tensor(plps), torch.tensor(rplps), rtol=0, atol=1e-5)

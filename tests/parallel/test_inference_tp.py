"""Generation under TP=2 (gloo) equals TP=1: greedy tokens, log-probs within 1e-5, seeded samples; and the
server's scheduling loop over TP=2 (rank 0 broadcasts each step's new prompts, rank 1 follows).

Layout-independent init gives both layouts the same weights; they differ only in the order of the
split matmul sums and all-reduces (~1e-7 in fp32), far inside the 1e-5 log-prob tolerance.
"""
import torch

from tests.parallel.dist_utils import run_distributed
from tests.unit.core.inference.test_engine import MAX_LEN, build_tiny_gpt, prompts


def _generate(arch: str, tp: int):
    from megatron.core.inference import InferenceEngine, SamplingParams

    model = build_tiny_gpt(arch, tp=tp)
    ps = prompts([5, 9, 3, 6], seed=4)
    params = [SamplingParams(top_k=1, num_tokens_to_generate=8, return_log_probs=True)] * 3 + \
             [SamplingParams(temperature=1.3, top_p=0.95, random_seed=3, num_tokens_to_generate=8,
                             return_log_probs=True)]
    reqs = InferenceEngine(model, max_batch_size=4, max_sequence_length=MAX_LEN).generate(ps, params)
    return [(r.generated_tokens, r.generated_log_probs, r.prompt_log_probs) for r in reqs]


def _serve(tp: int):
    """The server's loop without HTTP: rank 0 schedules prompts submitted from another thread (as request
    threads do) and broadcasts them; rank 1 follows. Returns rank 0's generated tokens."""
    import threading

    from megatron.core.inference import InferenceEngine, SamplingParams
    from megatron.inference.scheduler import GenerationScheduler, follow

    engine = InferenceEngine(build_tiny_gpt("llama", tp=tp), max_batch_size=4, max_sequence_length=MAX_LEN)
    if torch.distributed.get_rank() != 0:
        follow(engine)
        return None
    scheduler = GenerationScheduler(engine)
    tickets = []

    def clients():
        for i, p in enumerate(prompts([4, 7, 2, 9, 5], seed=5)):
            tickets.append(scheduler.submit(p, SamplingParams(top_k=1, num_tokens_to_generate=3 + 2 * i)))
        for t in tickets:
            t.done.wait()
        scheduler.stop()
    thread = threading.Thread(target=clients)
    thread.start()
    scheduler.run()
    thread.join()
    return [t.request.generated_tokens for t in tickets]


def _tp2_world():
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    out = {arch: _generate(arch, tp=2) for arch in ("gpt2", "llama")}
    out["served"] = _serve(tp=2)
    return out


def test_tp2_generation_equals_tp1():
    ranks = run_distributed(_tp2_world, 2)
    served = ranks[0].pop("served")
    ranks[1].pop("served")
    assert ranks[0] == ranks[1]  # both TP ranks agree on every token and number
    from megatron.core.inference import InferenceEngine, SamplingParams
    alone = [InferenceEngine(build_tiny_gpt("llama"), max_batch_size=1, max_sequence_length=MAX_LEN).generate(
        [p], SamplingParams(top_k=1, num_tokens_to_generate=3 + 2 * i))[0].generated_tokens
        for i, p in enumerate(prompts([4, 7, 2, 9, 5], seed=5))]
    assert served == alone  # the TP=2 serving loop (rank 0 broadcasting, rank 1 following) answers as TP=1
    for arch in ("gpt2", "llama"):
        ref = _generate(arch, tp=1)
        for (tokens, lps, plps), (rtokens, rlps, rplps) in zip(ranks[0][arch], ref):
            assert tokens == rtokens
            torch.testing.assert_close(torch.tensor(lps), torch.tensor(rlps), rtol=0, atol=1e-5)
            torch.testing.assert_close(torch.tensor(plps), torch.tensor(rplps), rtol=0, atol=1e-5)

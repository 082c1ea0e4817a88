"""The generation engine on CUDA: decode steps replayed from CUDA graphs (and compiled) give what the eager
steps give, with requests joining a running batch; run on a GPU machine, skipped elsewhere."""
import pytest
import torch

from megatron.core.inference import InferenceEngine, SamplingParams
from tests.unit.core.inference.test_engine import MAX_LEN, build_tiny_gpt, full_logits, joining_vs_alone, prompts

pytestmark = pytest.mark.gpu

PARAMS = [SamplingParams(top_k=1, num_tokens_to_generate=12, return_log_probs=True)] * 3 + \
         [SamplingParams(temperature=1.2, top_p=0.9, random_seed=4, num_tokens_to_generate=12, return_log_probs=True)]


def _run(model, **kw):
    engine = InferenceEngine(model, max_batch_size=4, max_sequence_length=MAX_LEN, **kw)
    reqs = engine.generate(prompts([5, 11, 2, 8]), PARAMS)
    return engine, [r.generated_tokens for r in reqs], torch.tensor([r.generated_log_probs for r in reqs])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_equals_eager(dtype):
    """A replayed graph runs the kernels the eager step runs: the same tokens and log-probs."""
    model = build_tiny_gpt("llama").cuda().to(dtype)
    _, eager_tokens, eager_lp = _run(model, use_cuda_graphs=False)
    engine, tokens, lp = _run(model)
    assert engine.graphs is not None and engine.graphs.graphs  # decode really went through graphs
    assert tokens == eager_tokens
    torch.testing.assert_close(lp, eager_lp, rtol=0, atol=1e-5)


def test_graphs_greedy_equal_full_recompute_and_joining_requests():
    """fp32: greedy tokens equal the argmax of the full forward; requests that join a running batch (and
    reuse freed slots) get their alone answers."""
    model = build_tiny_gpt("gpt2").cuda()
    for p in prompts([6, 3, 9], seed=1):
        req = InferenceEngine(model, max_batch_size=1, max_sequence_length=MAX_LEN).generate(
            [p], SamplingParams(top_k=1, num_tokens_to_generate=10))[0]
        logits = full_logits(model, p + req.generated_tokens)
        assert logits[len(p) - 1:-1].argmax(-1).tolist() == req.generated_tokens
    joined, alone = joining_vs_alone(model)
    assert joined == alone


@pytest.mark.parametrize("qk_norm", [True, False])
def test_compiled_decode_close_to_eager(qk_norm):
    """torch.compile fuses the element-wise work (other summation orders): log-probs within 1e-4 in fp32,
    far below the gaps between a random model's top logits, so the tokens agree. Without qk-norm the
    attention takes the fused-QKV path (``rope_and_store`` inlined in the compiled step)."""
    from tests.unit.core.inference.test_cuda_graphs import build_llama
    model = (build_tiny_gpt("llama") if qk_norm else build_llama()).cuda()
    _, eager_tokens, eager_lp = _run(model, use_cuda_graphs=False)
    engine, tokens, lp = _run(model, compile_decode=True)
    assert not engine._step_fn.fell_back
    assert tokens == eager_tokens
    torch.testing.assert_close(lp, eager_lp, rtol=0, atol=1e-4)


def test_graph_decode_64_steps_equals_eager_and_takes_graphs():
    """bf16, the fused-QKV layout (no qk-norm): 64 greedy steps replayed from graphs give exactly what the
    same bucketed steps give eagerly (same kernels, same shapes); the replay count proves every step
    went through a graph, across two KV buckets (64, 128). In fp32 the exact-shape eager decode agrees too."""
    from tests.unit.core.inference.test_cuda_graphs import MAX_LEN as LONG
    from tests.unit.core.inference.test_cuda_graphs import _prompts, build_llama
    ps = _prompts([20, 7, 13], seed=5)
    params = SamplingParams(top_k=1, num_tokens_to_generate=64, return_log_probs=True)

    def run(model, graphs=True, capture=True):
        engine = InferenceEngine(model, max_batch_size=4, max_sequence_length=LONG, use_cuda_graphs=graphs)
        if graphs:
            engine.graphs.capture = capture
        reqs = engine.generate(ps, params)
        return engine, [r.generated_tokens for r in reqs], torch.tensor([r.generated_log_probs for r in reqs])

    model = build_llama().cuda().to(torch.bfloat16)
    engine, tokens, lp = run(model)
    assert engine.graphs.replays == 63 and {k[1] for k in engine.graphs.graphs} == {64, 128}
    _, eager_tokens, eager_lp = run(model, capture=False)
    assert tokens == eager_tokens
    torch.testing.assert_close(lp, eager_lp, rtol=0, atol=1e-5)
    model = model.float()
    _, tokens, lp = run(model)
    _, exact_tokens, exact_lp = run(model, graphs=False)
    assert tokens == exact_tokens
    torch.testing.assert_close(lp, exact_lp, rtol=0, atol=1e-4)  # fp32; TF32 is off by default


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rope_and_store_equals_eager(dtype):
    """The compiled decode fusion writes the cache where the eager one does (and nowhere else) and
    returns the same queries; bf16 within one rounding (the compiled kernel rounds once, eager per op)."""
    from megatron.core.inference.decode_fusions import rope_and_store
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 4, 2, 6, 128, device="cuda", generator=g).to(dtype)
    angles = torch.rand(1, 4, 1, 1, 128, device="cuda", generator=g) * 6
    sign = torch.cat([-torch.ones(64, device="cuda"), torch.ones(64, device="cuda")])
    cos, sin = angles.cos().to(dtype), (angles.sin() * sign).to(dtype)
    kv = torch.randn(8, 2, 64, 2, 128, device="cuda", generator=g).to(dtype)
    positions = torch.tensor([5, 0, 63, 17], device="cuda")
    kv_eager = kv.clone()
    q_eager = rope_and_store.eager(x, cos, sin, kv_eager, positions)
    q = rope_and_store(x, cos, sin, kv, positions)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(q, q_eager, **tol)
    torch.testing.assert_close(kv, kv_eager, **tol)
    untouched = torch.ones(8, 64, dtype=torch.bool, device="cuda")
    untouched[torch.arange(4, device="cuda"), positions] = False
    assert torch.equal(kv.permute(0, 2, 1, 3, 4)[untouched], kv_eager.permute(0, 2, 1, 3, 4)[untouched])


def test_chunked_prefill_on_cuda_equals_whole_prompt_prefill():
    """--enable-chunked-prefill on CUDA (fp32): a 37-token prompt in chunks of 8 gives the tokens and prompt
    log-probs of its whole-prompt prefill."""
    from tests.unit.core.inference.test_chunked_prefill import whole_and_chunked
    from tests.unit.core.inference.test_cuda_graphs import _prompts, build_llama
    params = SamplingParams(top_k=1, num_tokens_to_generate=8, return_log_probs=True)
    whole, chunks = whole_and_chunked(build_llama(window=(12, 0)).cuda(), _prompts([37, 5], seed=4), params)
    for a, b in zip(whole, chunks):
        assert a.generated_tokens == b.generated_tokens
        torch.testing.assert_close(torch.tensor(b.prompt_log_probs), torch.tensor(a.prompt_log_probs),
                                   rtol=0, atol=1e-4)

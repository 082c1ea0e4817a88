"""The decode step a CUDA graph replays, run eagerly on CPU (fp32): batch and KV length rounded up to
buckets, attention over the padded cache with a mask built on device, the fused-QKV path (RoPE on
queries and keys together, key and value written into the cache at once). It must equal the
exact-shape eager decode token for token and in log-probs, and the full forward in logits.

Tolerance 1e-5: the padded KV length and the fused RoPE change only summation order and which
masked (exp(-inf) = 0) terms take part; fp32 results differ by ~1e-7.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.inference import InferenceEngine, SamplingParams, StaticInferenceContext
from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt

VOCAB, MAX_LEN = 96, 160


def build_llama(interleaved: bool = False, window=None):
    """RoPE, GQA (8 heads, 2 groups), RMSNorm, SwiGLU, no qk-norm: the layout that takes the fused path."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(11)
    cfg = tiny_config(hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
                      normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                      rotary_interleaved=interleaved, window_size=window, init_method_std=0.1)
    return tiny_gpt(cfg, VOCAB, MAX_LEN, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False).eval()


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("interleaved", [False, True])
def test_padded_decode_logits_equal_full_recompute(interleaved):
    """Decode two slots (of 4) for 5 steps with the exact KV length and with the whole cache (the graph
    bucket): both equal the logits of the full forward over the sequence so far."""
    model = build_llama(interleaved)
    seqs = _prompts([9, 4])
    slots = [2, 0]
    full = lambda seq: model(torch.tensor([seq]), torch.arange(len(seq))[None], None)[0, -1]  # noqa: E731
    with torch.inference_mode():
        for kv_len in (None, MAX_LEN):
            ctx = StaticInferenceContext(max_batch_size=4, max_sequence_length=MAX_LEN)
            run = [list(s) for s in seqs]
            padded = torch.tensor([run[0], run[1] + [0] * 5])
            ctx.set_prefill(torch.tensor(slots), torch.tensor([8, 3]))
            logits = model(padded, torch.arange(9).expand(2, 9), None, inference_context=ctx)[:, -1]
            for _ in range(5):
                for i, seq in enumerate(run):
                    ref = full(seq)
                    torch.testing.assert_close(logits[i], ref, rtol=0, atol=1e-5)
                    seq.append(int(ref.argmax()))
                tokens, positions = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
                for slot, seq in zip(slots, run):
                    tokens[slot], positions[slot] = seq[-1], len(seq) - 1
                ctx.set_decode(positions, kv_len or int(positions.max()) + 1)
                logits = model(tokens[:, None], positions[:, None], None, inference_context=ctx)[:, -1][slots]
            # Keys and values share one buffer, interleaved per position (one write per decoded token).
            keys, values = ctx.key_value_memory_dict[1]
            assert keys.data_ptr() == ctx._kv[1].data_ptr() and values.data_ptr() == keys.data_ptr() + 4 * 8


def test_bucketed_static_steps_equal_exact_eager_decode():
    """The engine's graph-shaped steps (use_cuda_graphs=True runs them eagerly on CPU) against exact shapes:
    3 requests (batch bucket 4), one crossing the KV bucket 64 -> 128, greedy and seeded sampling."""
    model = build_llama(window=(40, 0))  # a sliding window too: the device-built mask must honour it
    ps = _prompts([50, 11, 3], seed=1)
    params = [SamplingParams(top_k=1, num_tokens_to_generate=24, return_log_probs=True),
              SamplingParams(top_k=1, num_tokens_to_generate=9, return_log_probs=True),
              SamplingParams(temperature=1.3, top_p=0.9, random_seed=3, num_tokens_to_generate=24,
                             return_log_probs=True)]

    def run(static):
        engine = InferenceEngine(model, max_batch_size=4, max_sequence_length=MAX_LEN, use_cuda_graphs=static)
        reqs = engine.generate(ps, params)
        return engine, [r.generated_tokens for r in reqs], [torch.tensor(r.generated_log_probs) for r in reqs]

    exact, exact_tokens, exact_lp = run(False)
    static, tokens, lp = run(True)
    assert exact.graphs is None and static.graphs is not None and not static.graphs.capture
    assert static.graphs.replays == 23  # every decode step went through the bucketed path
    assert tokens == exact_tokens and [len(t) for t in tokens] == [24, 9, 24]
    for a, b in zip(lp, exact_lp):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_batch_ladder_halves_the_slots_and_trims_the_middle():
    """--inference-dynamic-batching-num-cuda-graphs: the decode graphs' batch sizes, Megatron's exponential ladder."""
    from megatron.core.inference.cuda_graphs import batch_ladder, ladder_bucket
    assert batch_ladder(24, 16) == [1, 3, 6, 12, 24]
    assert batch_ladder(64, 3) == [1, 32, 64]
    assert batch_ladder(8, 1) == [8]
    assert [ladder_bucket(n, [1, 3, 6, 12, 24]) for n in (1, 2, 3, 7, 24)] == [1, 3, 3, 12, 24]
    assert batch_ladder(24, 4, "linear") == [6, 12, 18, 24]
    assert batch_ladder(10, 4, "linear") == [3, 6, 9, 10]
    assert batch_ladder(8, 1, "linear") == [8]
    with pytest.raises(ValueError, match="must be >= 1"):
        batch_ladder(8, 0)


def test_two_batch_graphs_decode_like_exact_shapes():
    """With 2 batch graphs (sizes 1 and 8) three requests run padded to 8 rows: the same tokens as exact shapes."""
    model = build_llama()
    ps = _prompts([7, 11, 3], seed=2)
    params = SamplingParams(top_k=1, num_tokens_to_generate=6)
    exact = InferenceEngine(model, max_batch_size=8, max_sequence_length=MAX_LEN, use_cuda_graphs=False)
    two = InferenceEngine(model, max_batch_size=8, max_sequence_length=MAX_LEN, use_cuda_graphs=True,
                          num_batch_graphs=2)
    assert two.batch_sizes == [1, 8]
    assert ([r.generated_tokens for r in two.generate(ps, params)]
            == [r.generated_tokens for r in exact.generate(ps, params)])


def test_decode_step_traces_as_one_graph():
    """--torch-compile compiles the whole decode step: it must trace without a graph break (fullgraph) and,
    traced (aot_eager: the graph torch.compile would hand to inductor, run eagerly), give the eager tokens."""
    import torch._dynamo

    model = build_llama()
    ps = _prompts([6, 9], seed=2)
    params = SamplingParams(top_k=1, num_tokens_to_generate=6, return_log_probs=True)
    ref = InferenceEngine(model, max_batch_size=2, max_sequence_length=64, use_cuda_graphs=True).generate(ps, params)
    engine = InferenceEngine(model, max_batch_size=2, max_sequence_length=64, use_cuda_graphs=True)
    torch._dynamo.reset()
    step = torch.compile(engine._decode_step, dynamic=True, backend="aot_eager", fullgraph=True)
    engine._step_fn = engine.graphs.step_fn = step
    out = engine.generate(ps, params)
    torch._dynamo.reset()
    assert [r.generated_tokens for r in out] == [r.generated_tokens for r in ref]
    for a, b in zip(out, ref):
        torch.testing.assert_close(torch.tensor(a.generated_log_probs), torch.tensor(b.generated_log_probs),
                                   rtol=0, atol=1e-5)

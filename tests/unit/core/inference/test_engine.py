"""Generation engine against plain references (CPU, fp32): KV-cache decoding vs full recomputation,
batched vs one-by-one, continuous batching vs alone, seeded sampling, stop conditions.

Tolerance 1e-5 on logits/log-probs: the cached path computes the same sums as the full forward in
another order (one query row against cached keys vs a causal square), ~1e-7 apart in fp32.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.inference import InferenceEngine, SamplingParams, StaticInferenceContext
from megatron.core.inference.sampling import sample_tokens
from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt

VOCAB, MAX_LEN = 96, 64


def build_tiny_gpt(arch: str, seed: int = 7, tp: int = 1):
    """gpt2: learned positions, LayerNorm, GeLU, tied embeddings. llama: RoPE, GQA, RMSNorm, SwiGLU, qk-norm;
    mistral: llama with a 4-token sliding window; mistral_alternating: gpt-oss's attention, the window on layer 1
    only and learnt sinks."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed)
    if arch == "gpt2":
        return tiny_gpt(tiny_config(tensor_model_parallel_size=tp), VOCAB, MAX_LEN).eval()
    cfg = tiny_config(hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
                      normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                      qk_layernorm=True, tensor_model_parallel_size=tp,
                      window_size=(3, 0) if arch.startswith("mistral") else None,
                      # gpt-oss's attention: alternating windows (layer 1 windowed, layer 2 full), learnt sinks
                      window_attn_skip_freq=2 if arch == "mistral_alternating" else None,
                      softmax_type="learnable" if arch == "mistral_alternating" else "vanilla")
    model = tiny_gpt(cfg, VOCAB, MAX_LEN, spec=get_gpt_layer_local_spec(qk_layernorm=True),
                     position_embedding_type="rope", share_embeddings_and_output_weights=False).eval()
    with torch.no_grad():  # sinks far apart per head, so a head order mixed up in the KV-cache path shows
        for layer in model.decoder.layers:
            sink = getattr(layer.self_attention.core_attention, "softmax_offset", None)
            if sink is not None:
                sink.copy_(torch.linspace(-3.0, 3.0, sink.numel()))
    return model


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def full_logits(model, seq):
    dev = next(model.parameters()).device
    with torch.no_grad():
        return model(torch.tensor([seq], device=dev), torch.arange(len(seq), device=dev)[None], None)[0].float()


GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=10, return_log_probs=True)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral", "mistral_alternating"])
def test_kv_cache_logits_equal_full_recompute(arch):
    """Prefill two prompts into slots 2 and 0, then decode both: each step's logits equal the full
    forward over the whole sequence so far."""
    model = build_tiny_gpt(arch)
    ctx = StaticInferenceContext(max_batch_size=3, max_sequence_length=MAX_LEN)
    seqs = prompts([7, 4])
    slots = [2, 0]
    with torch.inference_mode():
        padded = torch.tensor([seqs[0], seqs[1] + [0] * 3])
        ctx.set_prefill(torch.tensor(slots), torch.tensor([6, 3]))
        logits = model(padded, torch.arange(7).expand(2, 7), None, inference_context=ctx)[:, -1]
        for step in range(6):
            for i, seq in enumerate(seqs):
                ref = full_logits(model, seq)[-1]
                torch.testing.assert_close(logits[i], ref, rtol=0, atol=1e-5)
                seq.append(int(ref.argmax()))
            tokens, positions = torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
            for slot, seq in zip(slots, seqs):
                tokens[slot], positions[slot] = seq[-1], len(seq) - 1
            ctx.set_decode(positions, int(positions.max()) + 1)
            out = model(tokens[:, None], positions[:, None], None, inference_context=ctx)[:, -1]
            logits = out[slots]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_engine_greedy_equals_recompute_and_batching(arch):
    """Greedy tokens and log-probs equal full recomputation; a batch of different-length prompts gives
    each prompt what it gives alone; prompt log-probs match too."""
    model = build_tiny_gpt(arch)
    ps = prompts([5, 11, 2, 8])
    batched = InferenceEngine(model, max_batch_size=4, max_sequence_length=MAX_LEN).generate(ps, GREEDY)
    for p, req in zip(ps, batched):
        alone = InferenceEngine(model, max_batch_size=1, max_sequence_length=MAX_LEN).generate([p], GREEDY)[0]
        assert req.generated_tokens == alone.generated_tokens
        torch.testing.assert_close(torch.tensor(req.generated_log_probs), torch.tensor(alone.generated_log_probs),
                                   rtol=0, atol=1e-5)
        logits = full_logits(model, p + req.generated_tokens)
        n = len(p)
        assert logits[n - 1:-1].argmax(-1).tolist() == req.generated_tokens
        ref = torch.log_softmax(logits, -1)
        gen_lp = ref[n - 1:-1].gather(-1, torch.tensor(req.generated_tokens)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(req.generated_log_probs), gen_lp, rtol=0, atol=1e-5)
        prompt_lp = ref[:n - 1].gather(-1, torch.tensor(p[1:])[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(req.prompt_log_probs), prompt_lp, rtol=0, atol=1e-5)


def joining_vs_alone(model):
    """(tokens of requests arriving one per step into a 2-slot engine, tokens of each alone)."""
    ps = prompts([6, 3, 9, 4, 7], seed=1)
    lengths = [3, 12, 5, 8, 6]
    alone = [InferenceEngine(model, max_batch_size=1, max_sequence_length=MAX_LEN).generate(
        [p], SamplingParams(top_k=1, num_tokens_to_generate=n))[0].generated_tokens for p, n in zip(ps, lengths)]
    engine = InferenceEngine(model, max_batch_size=2, max_sequence_length=MAX_LEN)
    with torch.inference_mode():
        reqs = [engine.add_request(ps[0], SamplingParams(top_k=1, num_tokens_to_generate=lengths[0]))]
        engine.step()
        engine.step()
        for p, n in zip(ps[1:], lengths[1:]):  # arrive mid-run; only 2 slots, so they queue and rotate
            reqs.append(engine.add_request(p, SamplingParams(top_k=1, num_tokens_to_generate=n)))
            engine.step()
        while engine.has_work():
            engine.step()
    return [r.generated_tokens for r in reqs], alone


def test_continuous_batching_join_and_leave():
    """Requests joining a running batch (and slots reused after others leave) get their alone answers."""
    joined, alone = joining_vs_alone(build_tiny_gpt("llama"))
    assert joined == alone


def test_seeded_sampling_reproducible():
    model = build_tiny_gpt("gpt2")
    ps = prompts([4, 6], seed=2)
    sp = dict(temperature=1.5, num_tokens_to_generate=12)

    def run(seed, batch_with_other=True, **kw):
        engine = InferenceEngine(model, max_batch_size=2, max_sequence_length=MAX_LEN)
        params = [SamplingParams(random_seed=seed, **sp, **kw), SamplingParams(random_seed=99, **sp)]
        return engine.generate(ps if batch_with_other else ps[:1], params)[0].generated_tokens

    a = run(5)
    assert a == run(5) == run(5, batch_with_other=False)  # same seed: same tokens, whoever shares the batch
    assert a != run(6)
    assert run(5, top_k=3) == run(5, top_k=3)
    assert run(5, top_p=0.9) == run(5, top_p=0.9)


def test_sampling_filters_and_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]]).repeat(4000, 1)
    u = torch.rand(4000, generator=torch.Generator().manual_seed(0))
    ones = torch.ones(4000)

    def draw(top_k=0, top_p=0.0, temperature=1.0):
        return sample_tokens(logits, ones * temperature, torch.full((4000,), top_k), ones * top_p, u, False)

    freq = torch.bincount(draw(), minlength=5).float() / 4000
    # 4000 draws: the standard error of each frequency is <= 0.008; 0.03 is ~4 sigma.
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), rtol=0, atol=0.03)
    assert set(draw(top_k=2).tolist()) == {0, 1}
    # top_p 0.8: p = [.54, .20, .12, .03, .07]; the prefix reaching 0.8 is tokens 0, 1, 2.
    assert set(draw(top_p=0.8).tolist()) == {0, 1, 2}
    assert set(draw(temperature=0.0).tolist()) == {0}
    assert set(draw(top_k=1).tolist()) == {0}


def test_stop_on_eod_and_stop_words():
    model = build_tiny_gpt("llama")
    p = prompts([5], seed=3)[0]
    free = InferenceEngine(model, max_batch_size=1, max_sequence_length=MAX_LEN).generate(
        [p], SamplingParams(top_k=1, num_tokens_to_generate=12))[0].generated_tokens
    eod = free[4]
    first = free.index(eod)
    stopped = InferenceEngine(model, max_batch_size=1, max_sequence_length=MAX_LEN, termination_id=eod).generate(
        [p], SamplingParams(top_k=1, num_tokens_to_generate=12))[0]
    assert stopped.generated_tokens == free[:first + 1] and stopped.finish_reason == "stop"

    def detok(ids):  # a real, if trivial, vocabulary: token i spells "<i>"
        return "".join(f"<{i}>" for i in ids)

    word = f"<{free[2]}><{free[3]}>"
    req = InferenceEngine(model, max_batch_size=1, max_sequence_length=MAX_LEN, detokenize=detok).generate(
        [p], SamplingParams(top_k=1, num_tokens_to_generate=12, stop_words=[word]))[0]
    text = detok(free)
    assert req.finish_reason == "stop" and req.generated_text == text[:text.index(word)]
    assert len(req.generated_tokens) <= 4


def test_bad_requests_and_context_limit():
    model = build_tiny_gpt("gpt2")
    engine = InferenceEngine(model, max_batch_size=1, max_sequence_length=16)
    with pytest.raises(ValueError, match="exceeds the context"):
        engine.add_request(list(range(10)), SamplingParams(num_tokens_to_generate=7))
    with pytest.raises(ValueError, match="tokens_to_generate"):
        engine.add_request([1, 2], SamplingParams(num_tokens_to_generate=-1))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    req = engine.generate([list(range(10))], SamplingParams(top_k=1, num_tokens_to_generate=6))[0]
    assert len(req.generated_tokens) == 6 and req.length == 16


def test_abort_all_then_serve_again():
    """After a failed step the server aborts what is in flight; the engine then serves as new."""
    model = build_tiny_gpt("gpt2")
    engine = InferenceEngine(model, max_batch_size=2, max_sequence_length=MAX_LEN)
    p = prompts([5], seed=6)[0]
    reqs = [engine.add_request(p, SamplingParams(top_k=1, num_tokens_to_generate=8)) for _ in range(3)]
    engine.step()
    engine.abort_all("error: test")
    assert all(r.done.is_set() and r.finish_reason == "error: test" for r in reqs) and not engine.has_work()
    again = engine.generate([p], SamplingParams(top_k=1, num_tokens_to_generate=8))[0]
    alone = InferenceEngine(model, max_batch_size=1, max_sequence_length=MAX_LEN).generate(
        [p], SamplingParams(top_k=1, num_tokens_to_generate=8))[0]
    assert again.generated_tokens == alone.generated_tokens


def _field(line, name):
    return int(line.split(f"{name} ")[1].split(" |")[0])


@pytest.mark.parametrize("interval", [1, 3])
def test_step_log_counts_what_the_engine_did(interval):
    """--inference-logging-step-interval N: a line every N-th step; with N = 1 its prompt and generated token
    counts add up to the requests' own. 0 logs nothing."""
    model = build_tiny_gpt("llama")
    ps = prompts([5, 11, 2])
    lines = []
    engine = InferenceEngine(model, max_batch_size=2, max_sequence_length=MAX_LEN, log_step_interval=interval)
    engine.step_log.emit = lines.append
    reqs = engine.generate(ps, GREEDY)
    assert len(lines) == engine.step_log.steps // interval > 0
    assert lines[0].startswith(f"inference step {interval} | active requests ")
    if interval == 1:
        assert sum(_field(line, "prompt tokens") for line in lines) == sum(len(p) for p in ps)
        assert sum(_field(line, "generated tokens") for line in lines) == sum(len(r.generated_tokens) for r in reqs)
    silent = InferenceEngine(model, max_batch_size=2, max_sequence_length=MAX_LEN)
    silent.step_log.emit = lines.append
    before = len(lines)
    silent.generate(ps, GREEDY)
    assert len(lines) == before

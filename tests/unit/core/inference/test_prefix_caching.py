"""--inference-dynamic-batching-prefix-caching: a prompt starting with whole blocks another slot holds copies their
keys and values and prefills only the rest. Greedy tokens equal the engine's without the cache, token for token
(fp32, CPU): for prompts admitted together and one after the other, a finished request's prefix under lru (not
under ref_zero), a prompt that is all cached prefix (its last token recomputed), and a follow-up prompt that
continues a finished request's generated text; the reused-token counter says what was skipped."""
import pytest

from megatron.core.inference import InferenceEngine, SamplingParams
from megatron.core.inference.prefix_cache import PrefixCache
from tests.unit.core.inference.test_cuda_graphs import MAX_LEN, _prompts, build_llama

BLOCK = 4
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=6)


@pytest.fixture(scope="module")
def model():
    return build_llama()


def _engine(model, cached: bool, policy: str = "ref_zero", **kw):
    return InferenceEngine(model, max_batch_size=4, max_sequence_length=MAX_LEN, prefix_caching=cached,
                           prefix_block_size=BLOCK, prefix_eviction_policy=policy, **kw)


def _shared(prefix_len: int, suffix_lens, seed: int = 1):
    """Prompts of one common prefix and suffixes whose first tokens differ."""
    prefix, *suffixes = _prompts([prefix_len, *suffix_lens], seed=seed)
    return [prefix + [i] + s[1:] for i, s in enumerate(suffixes)]


def _run_in_turns(engine, turns):
    """Each turn's prompts generated to completion before the next turn's are added; the tokens of every request."""
    return [r.generated_tokens for prompts in turns for r in engine.generate(prompts, GREEDY)]


@pytest.mark.parametrize("chunked", [False, True])
def test_prefix_shared_by_prompts_admitted_together(model, chunked):
    ps = _shared(21, [3, 7, 12])  # the 20 tokens of 5 whole blocks are shared
    kw = dict(chunked_prefill=chunked, max_prefill_tokens=8 if chunked else 16384)
    plain = _engine(model, False, **kw).generate(ps, GREEDY)
    engine = _engine(model, True, **kw)
    cached = engine.generate(ps, GREEDY)
    assert [r.generated_tokens for r in cached] == [r.generated_tokens for r in plain]
    # the shortest prompt prefilled whole; the two others copied its 20 prefix tokens
    assert engine.prefix_cache.reused_tokens == 40
    assert engine.prefix_cache.computed_tokens == sum(map(len, ps)) - 40


def test_prefix_of_running_request_reused_by_later_one(model):
    """ref_zero: a request admitted while the first still decodes shares its prefix."""
    a, b = _shared(16, [5, 9], seed=2)
    long = SamplingParams(top_k=1, num_tokens_to_generate=12)

    def run(cached):
        engine = _engine(model, cached)
        first = engine.add_request(a, long)
        engine.step()
        engine.step()
        second = engine.add_request(b, GREEDY)
        while engine.has_work():
            engine.step()
        return engine, first.generated_tokens, second.generated_tokens

    _, *plain = run(False)
    engine, *cached = run(True)
    assert cached == plain
    assert engine.prefix_cache.reused_tokens == 16


@pytest.mark.parametrize("graphs", [False, True])
def test_finished_prefix_reused_under_lru_only(model, graphs):
    """A finished request's slot keeps its tokens under lru: the next request takes that slot and prefills only
    its own suffix (graphs: bucketed decode steps that keep writing into idle slots past their tokens)."""
    a, b = _shared(13, [4, 6], seed=3)
    turns = [[a], [b]]
    plain = _run_in_turns(_engine(model, False, use_cuda_graphs=graphs), turns)
    for policy, reused in (("ref_zero", 0), ("lru", 12)):
        engine = _engine(model, True, policy, use_cuda_graphs=graphs)
        assert _run_in_turns(engine, turns) == plain, policy
        assert engine.prefix_cache.reused_tokens == reused, policy


def test_lru_takes_matching_free_slot_else_least_recently_used(model):
    engine = _engine(model, True, "lru")
    x, y, z = _prompts([9, 9, 9], seed=5)
    rx, ry = engine.generate([x, y], GREEDY)
    (rz,) = engine.generate([z], GREEDY)  # nothing matches: the least recently used free slot
    assert rz.slot not in (rx.slot, ry.slot)
    (rx2,) = engine.generate([x[:8] + [1, 2]], GREEDY)  # x's slot, which holds the prefix
    assert rx2.slot == rx.slot and engine.prefix_cache.reused_tokens == 8


def test_prompt_all_cached_recomputes_last_token(model):
    """A prompt equal to (or a whole-block prefix of) a cached one: every token but the last is reused."""
    (a,) = _prompts([24], seed=6)
    turns = [[a], [a], [a[:16]]]
    plain = _run_in_turns(_engine(model, False), turns)
    engine = _engine(model, True, "lru")
    assert _run_in_turns(engine, turns) == plain
    assert engine.prefix_cache.reused_tokens == 23 + 15
    assert engine.prefix_cache.computed_tokens == 24 + 1 + 1


def test_follow_up_prompt_reuses_generated_tokens(model):
    """A chat's next turn (prompt + answer + new text): the answer's keys and values, written by decode steps,
    are reused too, all but the last generated token (never fed back)."""
    (a,) = _prompts([10], seed=7)
    engine = _engine(model, True, "lru")
    (first,) = engine.generate([a], GREEDY)
    follow = a + first.generated_tokens + [3, 4, 5]
    (second,) = engine.generate([follow], GREEDY)
    (alone,) = _engine(model, False).generate([follow], GREEDY)
    assert second.generated_tokens == alone.generated_tokens
    held = len(a) + len(first.generated_tokens) - 1
    assert engine.prefix_cache.reused_tokens == held // BLOCK * BLOCK


def test_step_log_counts_reused_tokens(model):
    engine = _engine(model, True, log_step_interval=1)
    lines = []
    engine.step_log.emit = lines.append
    engine.generate(_shared(8, [2, 3], seed=8), GREEDY)
    assert "prompt tokens 21 | reused prompt tokens 8 | generated tokens" in lines[0]
    plain = _engine(model, False, log_step_interval=1)
    plain.step_log.emit = lines.append
    plain.generate(_prompts([5]), GREEDY)
    assert "reused" not in lines[-1]


def test_matches_whole_blocks_only():
    cache = PrefixCache(3, block_size=4)
    assert cache.common_blocks([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8]) == 4
    cache.hold(1, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.match([1, 2, 3, 4, 5, 6, 7], own_slot=0) == (1, 4)
    assert cache.match([1, 2, 3, 4], own_slot=0) == (1, 3)  # the last prompt token is recomputed
    assert cache.match([1, 2, 3, 9], own_slot=0) == (None, 0)
    cache.release(1, [1, 2, 3, 4])  # ref_zero: a finished request's tokens are forgotten
    assert cache.match([1, 2, 3, 4, 5], own_slot=0) == (None, 0)


def test_refuses_recurrent_layers():
    from tests.unit.core.models.hybrid.test_hybrid_generation import build_tiny_hybrid
    with pytest.raises(NotImplementedError, match="--inference-dynamic-batching-prefix-caching with Mamba-2"):
        InferenceEngine(build_tiny_hybrid(), max_batch_size=2, max_sequence_length=64, prefix_caching=True)

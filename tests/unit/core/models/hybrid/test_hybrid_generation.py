"""The generation engine over a HybridModel of every recurrent and attention kind (Mamba-2, gated attention with
QK-norm and partial RoPE, Gated DeltaNet, MLP): greedy tokens equal the argmax of the full forward (fp32), eagerly
and in the bucketed static-shape steps a CUDA graph replays (idle slots step on garbage states), and requests
joining a running batch get their alone answers (a slot's states are reset by its prefill)."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.inference import InferenceEngine, SamplingParams
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from tests.fixtures.tiny_gpt import single_rank, tiny_config
from tests.unit.core.inference.test_engine import MAX_LEN, VOCAB, full_logits, joining_vs_alone, prompts


def build_tiny_hybrid(seed: int = 3, device: str = "cpu"):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    single_rank()
    model_parallel_cuda_manual_seed(seed)
    cfg = tiny_config(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                      normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                      qk_layernorm=True, attention_output_gate=True, mamba_state_dim=8, mamba_head_dim=8,
                      mamba_num_groups=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                      linear_num_value_heads=4, use_cpu_initialization=True)
    return HybridModel(cfg, get_hybrid_stack_spec(qk_layernorm=True), VOCAB, MAX_LEN, hybrid_layer_pattern="M*G-",
                       position_embedding_type="rope", rotary_percent=0.5).to(device).eval()


@pytest.mark.parametrize("graphs", [False, True])
def test_hybrid_greedy_equals_full_recompute(graphs):
    model = build_tiny_hybrid()
    ps = prompts([5, 11, 2, 8])
    reqs = InferenceEngine(model, max_batch_size=4, max_sequence_length=MAX_LEN, use_cuda_graphs=graphs).generate(
        ps, SamplingParams(top_k=1, num_tokens_to_generate=10))
    for p, req in zip(ps, reqs):
        logits = full_logits(model, p + req.generated_tokens)
        assert logits[len(p) - 1:-1].argmax(-1).tolist() == req.generated_tokens


def test_hybrid_requests_joining_a_running_batch_get_their_alone_answers():
    joined, alone = joining_vs_alone(build_tiny_hybrid())
    assert joined == alone


def test_decode_graph_warm_up_puts_the_recurrent_states_back():
    """A CUDA graph's capture first runs the step once eagerly; a hybrid's conv and SSM / delta-rule states
    are updated in place by that step and, unlike a KV-cache write, not idempotently: left advanced, every
    new graph shifted the states by a token (GPU decode diverged from eager after the first graph). The
    warm-up here is the same code the capture runs; the bare step shows the states do move."""
    model = build_tiny_hybrid()
    engine = InferenceEngine(model, max_batch_size=4, max_sequence_length=MAX_LEN, use_cuda_graphs=True)
    engine.generate(prompts([5, 11, 2, 8]), SamplingParams(top_k=1, num_tokens_to_generate=3))
    states = engine.context.recurrent_buffers()
    assert len(states) >= 4  # the Mamba-2 and Gated DeltaNet layers' conv and recurrent states
    before = [t.clone() for t in states]
    key = (4, 64, True)
    with torch.inference_mode():
        engine.graphs.warm_up(key)
        assert all(torch.equal(a, b) for a, b in zip(engine.context.recurrent_buffers(), before))
        engine.graphs.step_fn(*key)
    assert not all(torch.equal(a, b) for a, b in zip(engine.context.recurrent_buffers(), before))


def test_hybrid_cast_to_bf16_after_build_generates_in_bf16():
    """A model built in fp32 and cast with .to(bfloat16) (as generation scripts do) stays bf16 through its Mamba
    layers: the layer casts its input to params_dtype only for --fp32-residual-connection's fp32 stream."""
    model = build_tiny_hybrid().to(torch.bfloat16)
    layer = model.decoder.layers[0]
    x = torch.randn(5, 2, 32, dtype=torch.bfloat16)
    out = layer(x)
    assert (out[0] if isinstance(out, tuple) else out).dtype == torch.bfloat16
    reqs = InferenceEngine(model, max_batch_size=4, max_sequence_length=MAX_LEN).generate(
        prompts([5, 11]), SamplingParams(top_k=1, num_tokens_to_generate=4))
    assert [len(r.generated_tokens) for r in reqs] == [4, 4]

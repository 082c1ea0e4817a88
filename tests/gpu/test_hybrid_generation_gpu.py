"""Generation through hybrid models on CUDA: prefill (the Triton scans of mamba-ssm / fla when installed, with their
final states) then one-token recurrences equals the full sequence; decode steps replayed from CUDA graphs (the
per-slot conv and SSM states updated in place inside the graph) give what the eager steps give."""
import pytest
import torch

from megatron.core.inference import InferenceEngine, SamplingParams
from megatron.core.inference.contexts import StaticInferenceContext
from tests.unit.core.inference.test_engine import MAX_LEN, full_logits, prompts
from tests.unit.core.models.hybrid.test_hybrid_generation import build_tiny_hybrid
from tests.unit.core.ssm.test_mixers import _mixer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["mamba", "gdn"])
def test_mixer_prefill_then_decode_equals_full_sequence_on_cuda(kind):
    """fp32 inputs: the Triton chunked kernels (fp32 accumulation, tf32 off) vs the one-token recurrences."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    m = _mixer(kind).cuda().eval()
    m.layer_number = 1
    x = torch.randn(70, 2, 32, device="cuda")
    with torch.no_grad():
        full, _ = m(x)
        ctx = StaticInferenceContext(max_batch_size=2, max_sequence_length=128)
        lengths = torch.tensor([64, 40], device="cuda")
        ctx.set_prefill(torch.tensor([0, 1], device="cuda"), lengths - 1)
        m(x[:64], inference_context=ctx)
        for i in range(6):
            ctx.set_decode(lengths + i, kv_len=1)
            token = torch.stack([x[64 + i, 0], x[40 + i, 1]])[None]
            out, _ = m(token, inference_context=ctx)
            torch.testing.assert_close(out[0, 0], full[64 + i, 0], rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(out[0, 1], full[40 + i, 1], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hybrid_cuda_graph_decode_equals_eager(dtype):
    model = build_tiny_hybrid(device="cuda").to(dtype)
    params = SamplingParams(top_k=1, num_tokens_to_generate=12, return_log_probs=True)
    runs = []
    for graphs in (False, True):
        engine = InferenceEngine(model, max_batch_size=4, max_sequence_length=MAX_LEN, use_cuda_graphs=graphs)
        reqs = engine.generate(prompts([5, 11, 2, 8]), params)
        runs.append(([r.generated_tokens for r in reqs], torch.tensor([r.generated_log_probs for r in reqs])))
    assert engine.graphs is not None and engine.graphs.graphs  # decode really went through graphs
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=0, atol=1e-5)
    if dtype == torch.float32:
        for p, tokens in zip(prompts([5, 11, 2, 8]), runs[1][0]):
            assert full_logits(model, p + tokens)[len(p) - 1:-1].argmax(-1).tolist() == tokens

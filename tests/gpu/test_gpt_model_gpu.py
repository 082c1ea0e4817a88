"""GPTModel on one GPU: bf16 training steps, device-side init and the RNG tracker on CUDA."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model(**kw):
    cfg = tiny_config(hidden_size=64, num_attention_heads=8, num_query_groups=4, normalization="RMSNorm",
                      gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bf16=True,
                      params_dtype=torch.bfloat16, **kw)
    model = tiny_gpt(cfg, vocab_size=128, max_sequence_length=32, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    return Float16Module(cfg, model)


def test_bf16_training_on_cuda():
    model_parallel_cuda_manual_seed(1234)
    model = _model(attention_dropout=0.1, hidden_dropout=0.1)
    p = next(model.parameters())
    assert p.is_cuda and p.dtype == torch.bfloat16
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (4, 33), device="cuda")
    pos = torch.arange(32, device="cuda").expand(4, 32)
    losses = []
    for _ in range(8):
        loss = model(ids[:, :-1], pos, None, labels=ids[:, 1:]).mean()
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_device_init_is_deterministic_and_tracker_forks_cuda_state():
    a, b = _model(), _model()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    model_parallel_cuda_manual_seed(5)
    before = torch.cuda.get_rng_state()
    with get_cuda_rng_tracker().fork():
        torch.rand(3, device="cuda")
    assert torch.equal(before, torch.cuda.get_rng_state())

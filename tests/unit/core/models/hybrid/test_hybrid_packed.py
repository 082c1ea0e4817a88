"""Packed sequences through a hybrid model: a row holding several documents (cu_seqlens, positions restarting
per document) gives each document the logits it gets alone, through Mamba-2, Gated DeltaNet, attention and MLP
layers (fp32, CPU, 1e-5 relative): the short convs never read back into the previous document and every
document's scan starts from a zero state. Gradients flow through every recurrent parameter."""
import pytest
import torch

from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from tests.fixtures.tiny_gpt import VOCAB, single_rank, tiny_config

LENGTHS = [5, 11, 3, 13]  # one row of 32 tokens: four documents, two shorter than the conv + a chunk


@pytest.fixture(scope="module")
def model():
    single_rank()
    model_parallel_cuda_manual_seed(1234)
    cfg = tiny_config(num_layers=4, ffn_hidden_size=64, normalization="RMSNorm", add_bias_linear=False,
                      mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, is_hybrid_model=True)
    m = HybridModel(cfg, get_hybrid_stack_spec(), VOCAB, 64, hybrid_layer_pattern="MG*-",
                    share_embeddings_and_output_weights=True, position_embedding_type="rope")
    m.decoder.layers[0].mixer.chunk_size = 4  # several chunks per document, and documents inside one chunk
    return m.eval()


def test_packed_row_equals_documents_alone(model):
    torch.manual_seed(0)
    docs = [torch.randint(0, VOCAB, (1, n)) for n in LENGTHS]
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(LENGTHS), 0).tolist(), dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS),
                             max_seqlen_kv=max(LENGTHS))
    ids = torch.cat(docs, dim=1)
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    with torch.no_grad():
        got = model(ids, pos, None, packed_seq_params=packed)  # [1, 32, V]
        alone = torch.cat([model(d, torch.arange(d.size(1)).unsqueeze(0), None) for d in docs], dim=1)
        unpacked = model(ids, pos, None)  # the same row without boundaries: the documents leak into each other
    err = ((got - alone).abs().max() / alone.abs().max()).item()
    assert err < 1e-5, err
    assert ((unpacked - alone).abs().max() / alone.abs().max()).item() > 1e-3


def test_packed_gradients_reach_the_recurrent_parameters(model):
    cu = torch.tensor([0, 7, 16], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(7), torch.arange(9)]).unsqueeze(0)
    model.zero_grad()
    model.train()
    model(ids, pos, None, labels=torch.roll(ids, -1, 1), packed_seq_params=packed).sum().backward()
    model.eval()
    for name in ("decoder.layers.0.mixer.conv1d.weight", "decoder.layers.0.mixer.A_log",
                 "decoder.layers.1.self_attention.conv1d.weight", "decoder.layers.1.self_attention.A_log"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name

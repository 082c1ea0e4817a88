"""VocabParallelEmbedding's weight gradient accumulated into main_grad (gradient-accumulation fusion)
against the dense gradient."""
import torch


def test_embedding_wgrad_goes_into_main_grad():
    """With gradient_accumulation_fusion the embedding's weight gradient is accumulated into the DDP
    buffer (main_grad) row by row; it must equal the dense gradient, with repeated ids summed. A tied
    embedding (zero_out_wgrad) and a weight without main_grad keep the ordinary dense .grad."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3, 7), generator=g)
    ids[0, :3] = 5  # repeated rows accumulate
    for case in ("fused", "tied", "no_main_grad", "off"):
        cfg = ModelParallelConfig(gradient_accumulation_fusion=case != "off")
        emb = VocabParallelEmbedding(50, 8, init_method=torch.nn.init.normal_, config=cfg)
        if case != "no_main_grad":
            emb.weight.main_grad = torch.ones(50, 8)
            emb.weight.grad_added_to_main_grad = False
        if case == "tied":
            emb.weight.zero_out_wgrad = True
        out = emb(ids)
        grad = torch.randn(out.shape, generator=g)
        out.backward(grad)
        dense = torch.zeros(50, 8).index_add_(0, ids.flatten(), grad.reshape(-1, 8))
        if case == "fused":
            torch.testing.assert_close(emb.weight.main_grad - 1, dense, rtol=1e-6, atol=1e-6)
            assert emb.weight.grad_added_to_main_grad
        else:
            torch.testing.assert_close(emb.weight.grad, dense, rtol=1e-6, atol=1e-6)
            if case != "no_main_grad":
                assert torch.equal(emb.weight.main_grad, torch.ones(50, 8))


def test_foreign_tokens_spread_over_rows():
    """Tokens another TP rank owns look up spread rows (zeroed after), not all row 0: one long run of equal
    indices serialises the backward's sorted row accumulation. The rows stay in the shard, and distinct
    while the tokens fit in it."""
    from megatron.core.tensor_parallel.layers import _spread_rows
    ids = _spread_rows(torch.zeros(4, 6, dtype=torch.long), 10)
    assert ids.shape == (4, 6) and ids.min() >= 0 and ids.max() < 10
    assert len(set(_spread_rows(torch.zeros(2, 5, dtype=torch.long), 10).flatten().tolist())) == 10

"""Multi-token prediction: the loss and every gradient against a plain reference objective (one
process, fp32)."""
import torch
import torch.nn.functional as F

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from tests.fixtures.tiny_gpt import tiny_mla_config as _cfg

S, B, H, N = 8, 2, 32, 4


# fp32 on CPU; the references reorder sums (einsum vs. GEMM + SDPA): 1e-5 covers that rounding.
TOL = dict(rtol=1e-5, atol=1e-5)


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _mtp_model(**kw):
    cfg = _cfg(mtp_num_layers=2, mtp_loss_scaling_factor=0.3, rope_type="rope", **kw)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    torch.manual_seed(0)
    return GPTModel(cfg, spec, vocab_size=40, max_sequence_length=S, position_embedding_type="rope",
                    mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec)), cfg


def _reference_mtp_objective(model, cfg, ids, pos, labels, mask, depth_layers=None):
    """LM loss mean + scale/D * sum_k (MTP depth k mean loss), from the model's pieces called in plain
    order: depth k embeds the inputs rolled left by k and predicts the labels rolled left by k."""
    hidden = model.decoder(model.embedding(ids, pos), None)
    logits = hidden @ model.output_layer.weight.t()  # [s, b, V]
    token_loss = F.cross_entropy(logits.flatten(0, 1), labels.t().flatten(), reduction="none").view(S, B).t()
    objective = (token_loss * mask).sum() / mask.sum()
    stats = []
    for k, layer in enumerate(depth_layers or model.mtp.layers, start=1):
        shifted = torch.cat([ids[:, k:], torch.zeros_like(ids[:, :k])], dim=1)
        shifted_pos = torch.cat([pos[:, k:], torch.zeros_like(pos[:, :k])], dim=1)
        e = model.embedding(shifted, shifted_pos)
        x = torch.cat([_rms(e, layer.enorm.weight), _rms(hidden, layer.hnorm.weight)], dim=-1)
        x = x @ layer.eh_proj.weight.t()
        hidden = _rms(layer.transformer_layer(x)[0], layer.final_layernorm.weight)
        k_labels = torch.cat([labels[:, k:], torch.zeros_like(labels[:, :k])], dim=1)
        k_mask = torch.cat([mask[:, k:], torch.zeros_like(mask[:, :k])], dim=1)
        k_logits = hidden @ model.output_layer.weight.t()
        k_loss = F.cross_entropy(k_logits.flatten(0, 1), k_labels.t().flatten(), reduction="none").view(S, B).t()
        stats.append(((k_loss * k_mask).sum(), k_mask.sum()))
        objective = objective + cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers * stats[-1][0] / stats[-1][1]
    return objective, stats


def _assert_matches(model, grads, stats, ref_stats):
    """Per-depth loss sums and token counts, and every gradient (``grads``; the reference's are in ``.grad``)."""
    for (got_sum, got_n), (ref_sum, ref_n) in zip(stats, ref_stats):
        torch.testing.assert_close(got_sum, ref_sum.detach(), **TOL)
        assert got_n == ref_n
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=name)


def test_mtp_loss_and_gradients_match_plain_reference():
    model, cfg = _mtp_model()
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 40, (B, S), generator=g), torch.randint(0, 40, (B, S), generator=g)
    pos = torch.arange(S).expand(B, S)
    mask = (torch.rand(B, S, generator=g) > 0.2).float()
    out = model(ids, pos, None, labels=labels, loss_mask=mask)  # per-token LM loss, MTP attached
    (out * mask).sum().div(mask.sum()).backward()  # the GPT loss function: masked token mean
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    stats = model.mtp_loss_stats
    model.zero_grad()
    objective, ref_stats = _reference_mtp_objective(model, cfg, ids, pos, labels, mask)
    objective.backward()
    _assert_matches(model, grads, stats, ref_stats)
    assert grads["mtp.layers.1.eh_proj.weight"].abs().sum() > 0
    # Evaluation (and logits) see the main prediction only.
    model.eval()
    torch.testing.assert_close(model(ids, pos, None, labels=labels), out.detach(), **TOL)
    assert model.mtp_loss_stats is None


def test_repeated_mtp_layer_is_one_layer_applied_at_every_depth():
    """--mtp-use-repeated-layer: one set of MTP weights (mtp.layers.0 only); the objective is the reference's with
    that layer at both depths, and its gradients sum both depths' contributions."""
    model, cfg = _mtp_model(mtp_use_repeated_layer=True)
    assert len(model.mtp.layers) == 1 and not any(n.startswith("mtp.layers.1.") for n, _ in model.named_parameters())
    g = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(0, 40, (B, S), generator=g), torch.randint(0, 40, (B, S), generator=g)
    pos = torch.arange(S).expand(B, S)
    mask = (torch.rand(B, S, generator=g) > 0.2).float()
    out = model(ids, pos, None, labels=labels, loss_mask=mask)
    (out * mask).sum().div(mask.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    stats = model.mtp_loss_stats
    assert len(stats) == 2
    model.zero_grad()
    objective, ref_stats = _reference_mtp_objective(model, cfg, ids, pos, labels, mask,
                                                    depth_layers=[model.mtp.layers[0]] * 2)
    objective.backward()
    _assert_matches(model, grads, stats, ref_stats)

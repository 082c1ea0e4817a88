"""BERT under PP=2 (and TP=2 x PP=2 on 4 ranks is left to the GPT suite) trains to the TP=PP=1 losses
through the real pipeline schedule: 6 Adam steps, fp32, dropout 0, legacy (loss, dict) reporting.

Stages differ from the single-stage model only in where the tied embedding / output weight lives
(its grads are summed over the embedding group), so losses agree to float rounding (<1e-5 relative).
"""
import torch
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.fixtures.tiny_gpt import tiny_config
from tests.parallel.dist_utils import run_distributed
from tests.parallel.test_pipeline_gpt import _reduce_grads

SEQ, MBS, VOCAB, GBS, ITERS, LAYERS = 16, 2, 128, 8, 6, 4


def _batches(iteration):
    g = torch.Generator().manual_seed(iteration)
    out = []
    for _ in range(GBS // MBS):
        lengths = torch.randint(SEQ // 2, SEQ + 1, (MBS,), generator=g)
        padding = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        loss_mask = ((torch.rand(MBS, SEQ, generator=g) < 0.2).long() * padding).float()
        loss_mask[:, 1] = 1.0
        out.append({"text": torch.randint(5, VOCAB, (MBS, SEQ), generator=g), "padding_mask": padding,
                    "types": (torch.arange(SEQ)[None, :] >= (lengths // 2)[:, None]).long() * padding,
                    "labels": torch.where(loss_mask > 0, torch.randint(0, VOCAB, (MBS, SEQ), generator=g), -1),
                    "loss_mask": loss_mask, "is_random": torch.randint(0, 2, (MBS,), generator=g)})
    return out


def forward_step_func(data_iterator, model):
    b = next(data_iterator)
    out = model(b["text"], b["padding_mask"], tokentype_ids=b["types"], lm_labels=b["labels"])

    def loss_func(output):
        lm, sop_logits = output
        lm_loss = (lm * b["loss_mask"]).sum() / b["loss_mask"].sum()
        sop_loss = F.cross_entropy(sop_logits, b["is_random"])
        return lm_loss + sop_loss, {"lm loss": lm_loss.detach(), "sop loss": sop_loss.detach()}

    return out, loss_func


def _train(pp):
    from megatron.core.models.bert.bert_layer_specs import get_bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    cfg = tiny_config(num_layers=LAYERS, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
    model = BertModel(cfg, 2, get_bert_layer_local_spec(), VOCAB, SEQ,
                      pre_process=parallel_state.is_pipeline_first_stage(),
                      post_process=parallel_state.is_pipeline_last_stage(), share_embeddings_and_output_weights=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    schedule = get_forward_backward_func()
    losses = []
    for it in range(ITERS):
        opt.zero_grad(set_to_none=False)
        dicts = schedule(forward_step_func=forward_step_func, data_iterator=iter(_batches(it)), model=[model],
                         num_microbatches=GBS // MBS, seq_length=SEQ, micro_batch_size=MBS)
        _reduce_grads([model])
        opt.step()
        if dicts:
            losses.append([torch.stack([d[k] for d in dicts]).mean().item() for k in ("lm loss", "sop loss")])
    parallel_state.destroy_model_parallel()
    return losses


def _pp2_then_pp1():
    return _train(2), _train(1)


def test_bert_pp2_matches_pp1():
    (pp2_first, ref), (pp2_last, ref_again) = run_distributed(_pp2_then_pp1, 2)
    assert pp2_first == []  # losses live on the last stage only
    assert ref[-1][0] < ref[0][0]  # it trains
    torch.testing.assert_close(torch.tensor(pp2_last), torch.tensor(ref), rtol=1e-5, atol=0)

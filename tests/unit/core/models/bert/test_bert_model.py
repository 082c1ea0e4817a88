"""BertModel's output-layer options: Megatron's `output_layer_bias` and `apply_lm_head`."""
import torch

from megatron.core.models.bert.bert_layer_specs import get_bert_layer_local_spec
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from tests.fixtures.tiny_gpt import tiny_config

VOCAB, SEQ = 64, 8


def _bert(**kw):
    model_parallel_cuda_manual_seed(123)
    config = tiny_config(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    return BertModel(config=config, num_tokentypes=2, transformer_layer_spec=get_bert_layer_local_spec(),
                     vocab_size=VOCAB, max_sequence_length=SEQ, add_binary_head=False, **kw)


def _logits(model):
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    return model(tokens, torch.ones(2, SEQ, dtype=torch.long))[0]


def test_output_layer_bias_false_has_no_bias():
    assert _bert().output_layer.bias is not None
    model = _bert(output_layer_bias=False)
    assert model.output_layer.bias is None and "output_layer.bias" not in model.state_dict()
    assert _logits(model).shape == (2, SEQ, VOCAB)


def test_apply_lm_head_false_projects_the_encoder_output():
    model = _bert(apply_lm_head=False)
    assert model.lm_head is None and not any(k.startswith("lm_head.") for k in model.state_dict())
    assert _logits(model).shape == (2, SEQ, VOCAB)

"""--experimental-attention-variant gated_delta_net --linear-attention-freq in a GPT model (Qwen3-Next's layout): the
marked layers run a Gated DeltaNet in the self-attention place, behind the same input norm and before the same
MLP. With the weights copied across, the GPT model [GDN + MLP, attention + MLP] gives the logits of the hybrid
stack 'G-*-' (whose G and - layers split the same two residual blocks into two layers), fp32 on CPU; and
gradients reach every Gated DeltaNet parameter."""
import re

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import linear_attention_pattern
from tests.fixtures.tiny_gpt import VOCAB, single_rank, tiny_config

GDN = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)


def test_linear_attention_pattern():
    assert linear_attention_pattern(4, 8) == [1, 1, 1, 0, 1, 1, 1, 0]
    assert linear_attention_pattern([1, 0, 1], 3) == [1, 0, 1]
    with pytest.raises(ValueError, match="one 1 .* per layer .3 layers"):
        linear_attention_pattern([1, 0], 3)


def _hybrid_key(key: str) -> str:
    """A GPT layer i's key in the hybrid stack 'G-*-': its self-attention part is layer 2i, its MLP part 2i + 1."""
    if key == "decoder.final_layernorm.weight":
        return "decoder.final_norm.weight"
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", key)
    if m is None:
        return key
    i, rest = int(m.group(1)), m.group(2)
    part = 2 * i + (1 if rest.startswith(("pre_mlp_layernorm", "mlp")) else 0)
    return f"decoder.layers.{part}.{rest}"


def test_gpt_with_gated_delta_net_layers_equals_the_hybrid_stack():
    single_rank()
    model_parallel_cuda_manual_seed(1234)
    common = dict(num_layers=2, ffn_hidden_size=64, normalization="RMSNorm", add_bias_linear=False, **GDN)
    cfg = tiny_config(experimental_attention_variant="gated_delta_net", linear_attention_freq=[1, 0], **common)
    gpt = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, normalization="RMSNorm"), VOCAB, 64,
                   position_embedding_type="rope")
    kinds = [type(layer.self_attention).__name__ for layer in gpt.decoder.layers]
    assert kinds == ["GatedDeltaNet", "SelfAttention"]
    hybrid_cfg = tiny_config(is_hybrid_model=True, **{**common, "num_layers": 4})
    hybrid = HybridModel(hybrid_cfg, get_hybrid_stack_spec(checkpoint_key_names="local"), VOCAB, 64,
                         hybrid_layer_pattern="G-*-", position_embedding_type="rope")
    source = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    target = hybrid.state_dict()
    mapped = {_hybrid_key(k): v for k, v in source.items()}
    missing = sorted(k for k in target if not k.endswith("_extra_state") and k not in mapped)
    assert not missing, missing
    assert set(mapped) <= set(target), sorted(set(mapped) - set(target))
    hybrid.load_state_dict({**target, **mapped})
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 24))
    pos = torch.arange(24).unsqueeze(0).expand(2, -1)
    got = gpt(ids, pos, None)
    want = hybrid(ids, pos, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.float().square().mean().backward()
    gdn = gpt.decoder.layers[0].self_attention
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gdn.parameters())


def test_gpt_with_gated_delta_net_layers_generates_like_its_full_forward():
    """The generation engine keeps the Gated DeltaNet layers' conv and delta-rule states per slot (as for the
    hybrid stack): greedy tokens equal the argmax of the full forward, with requests of different lengths."""
    import torch.nn.functional as F

    from megatron.core.inference import InferenceEngine, SamplingParams
    from tests.unit.core.inference.test_engine import MAX_LEN, full_logits, prompts
    from tests.unit.core.inference.test_engine import VOCAB as ENGINE_VOCAB
    single_rank()
    model_parallel_cuda_manual_seed(5)
    cfg = tiny_config(num_layers=4, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                      normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                      experimental_attention_variant="gated_delta_net", linear_attention_freq=2, **GDN)
    model = GPTModel(cfg, get_gpt_decoder_block_spec(cfg, normalization="RMSNorm"), ENGINE_VOCAB, MAX_LEN,
                     position_embedding_type="rope").eval()
    ps = prompts([5, 11, 2, 8])
    reqs = InferenceEngine(model, max_batch_size=4, max_sequence_length=MAX_LEN).generate(
        ps, SamplingParams(top_k=1, num_tokens_to_generate=8))
    for p, req in zip(ps, reqs):
        logits = full_logits(model, p + req.generated_tokens)
        assert logits[len(p) - 1:-1].argmax(-1).tolist() == req.generated_tokens

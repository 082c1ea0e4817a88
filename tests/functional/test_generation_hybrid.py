"""Tiny random Hugging Face hybrids (Mamba2; Nemotron-H with Mamba, attention and MLP layers; Qwen3-Next with
Gated DeltaNet, gated attention with partial RoPE, MoE and MLP layers), converted with
import_hf_checkpoint, generate through tools/generate.py exactly the tokens of transformers' greedy generate():
prompts of different lengths share one right-padded prefill, then every token comes from the per-request conv
and SSM states (and the attention layers' KV cache). Nemotron-H also at TP=2 (2 gloo ranks): the heads and
their states split over the ranks.

Both sides run fp32 on CPU; greedy choices could only differ on a near-tie of the top two logits (gaps ~1e-2,
the two forwards differ by ~1e-6).
"""
import pytest
import torch

from tests.functional.cli_runner import CliRunner
from tests.functional.test_generation_hf import NEW, PROMPTS, VOCAB, _generate

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def cli():
    with CliRunner() as runner:  # torch and the entry points imported once; each generation forks its ranks
        yield runner


def _configs():
    from transformers import Mamba2Config, NemotronHConfig, Qwen3NextConfig
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    common = dict(vocab_size=VOCAB, hidden_size=64, bos_token_id=1, eos_token_id=VOCAB - 1, pad_token_id=0,
                  tie_word_embeddings=False)
    return {"mamba2": Mamba2Config(**common, num_heads=16, head_dim=8, state_size=16, n_groups=2, num_hidden_layers=2,
                                   chunk_size=8, expand=2),
            "nemotron_h": NemotronHConfig(**common, layers_block_type=[kinds[c] for c in "M*-M-"],
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          intermediate_size=128, mamba_num_heads=16, mamba_head_dim=8,
                                          ssm_state_size=16, n_groups=2, chunk_size=8, max_position_embeddings=128),
            "qwen3_next": Qwen3NextConfig(**common, intermediate_size=96, num_hidden_layers=3,
                                          layer_types=["linear_attention", "full_attention", "linear_attention"],
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                                          linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                          mlp_only_layers=[1], max_position_embeddings=128)}


@pytest.mark.parametrize("family", ["mamba2", "nemotron_h", "qwen3_next"])
def test_converted_hybrid_greedy_equals_transformers(cli, tmp_path, family):
    from transformers import AutoModelForCausalLM

    from megatron.training.checkpointing.hf import import_hf_checkpoint

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_configs()[family]).eval()
    with torch.no_grad():  # large router weights: top-k far from ties (a routing flip would change the text)
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    hf.save_pretrained(hf_dir)
    import_hf_checkpoint(hf_dir, ckpt, tp=1)
    expected = []
    with torch.no_grad():
        for p in PROMPTS:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    assert all(len(set(e)) > 3 for e in expected)  # real continuations, not an immediate stop
    assert _generate(cli, ckpt, 1) == expected
    if family == "nemotron_h":
        assert _generate(cli, ckpt, 2) == expected

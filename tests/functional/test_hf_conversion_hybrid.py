"""Hybrid models (Mamba2, Nemotron-H, Qwen3-Next) <-> our checkpoints, proven by logits against transformers'.

Tiny random HF models (fp32, CPU; transformers' torch fallbacks, no mamba-ssm / causal-conv1d / fla): Mamba2 (two
Mamba layers), Nemotron-H (pattern M*-M*-: Mamba, GQA attention without position embedding, squared-ReLU MLP) and
Qwen3-Next (GE*-GE: Gated DeltaNet + MoE with a gated shared expert, gated attention with QK-norm and partial RoPE
+ a dense MLP, zero-centred norms). Each is imported at TP=1 and (through tools/checkpoint/hf.py) at TP=2; ONE
spawned 2-rank gloo world loads them under TP=1 (2 replicas), TP=2 and PP=2, then moves every weight (a stand-in
for training) and saves, so export is checked on weights that are not the imported ones.
"""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from tests.fixtures.hf_checks import max_rel_err, safetensors_in  # noqa: E402
from tests.functional.test_hf_conversion import (  # noqa: E402
    SEQ,
    VOCAB,
    _build_hf,
    _cli,
    _hf_logits,
    forward_logits,
    load_ours,
)
from tests.functional.test_hf_conversion_moe import _build_moe, _perturb  # noqa: E402
from tests.parallel.dist_utils import run_distributed  # noqa: E402

# fp32 on CPU, the same operations as transformers in another order (chunked scans of other chunk sizes, TP
# splits): measured ~7e-7 relative. A dropped gated-norm group or a swapped B/C section moves them > 1e-2; so does
# a shared-expert gate left out (7e-2). Routing is discrete: router weights are drawn large (no top-k near ties).
RTOL = 1e-5
HYBRID = ["mamba2", "nemotron_h", "qwen3_next"]


def _hybrid_configs():
    from transformers import Mamba2Config, NemotronHConfig, Qwen3NextConfig
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    return {
        "mamba2": Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_heads=8, head_dim=8, state_size=8, n_groups=2,
                               num_hidden_layers=2, chunk_size=8, expand=2, tie_word_embeddings=False),
        # softplus(dt) stays far above time_step_min (dt_bias ~ N(0, 0.1)), so HF's clamp there never acts
        "nemotron_h": NemotronHConfig(vocab_size=VOCAB, hidden_size=32, layers_block_type=[kinds[c] for c in "M*-M*-"],
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                                      mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=8,
                                      max_position_embeddings=64, tie_word_embeddings=False),
        "qwen3_next": Qwen3NextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      layer_types=["linear_attention", "full_attention", "linear_attention"],
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
                                      linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=24, mlp_only_layers=[1], norm_topk_prob=True,
                                      max_position_embeddings=64, tie_word_embeddings=False),
    }


def _world_fn(phases, tokens):
    """Per phase (tp, pp, checkpoints, save dirs): logits of each checkpoint; with a save dir, then the logits
    after `_perturb` and a save there."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training.checkpointing import save_checkpoint
    out = []
    for tp, pp, ckpts, saves in phases:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        model_parallel_cuda_manual_seed(1)
        for ckpt, save in zip(ckpts, saves):
            extra = ("--save", save, "--save-interval", "1", "--no-save-optim", "--no-save-rng") if save else ()
            model = load_ours(ckpt, tp, pp, 1, extra)
            out.append(forward_logits(model, tokens))
            if save:
                _perturb(model)
                out.append(forward_logits(model, tokens))
                save_checkpoint(1, model, None, None, 0)
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from megatron.training.checkpointing.hf import import_hf_checkpoint
    root = tmp_path_factory.mktemp("hfhybrid")
    d = {name: str(root / name) for name in HYBRID}
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ref = {}
    for name, cfg in _hybrid_configs().items():
        ref[name] = _hf_logits((_build_moe if name == "qwen3_next" else _build_hf)(cfg, d[name]), tokens)
        import_hf_checkpoint(d[name], d[name] + "_tp1")
        _cli("hf.py", "import", "--hf-model-path", d[name], "--output-path", d[name] + "_tp2", "--tp", "2")
    trained = {n: str(root / f"{n}_trained") for n in HYBRID}
    phases = [(1, 1, [d[n] + "_tp1" for n in HYBRID], [None] * len(HYBRID)),
              (2, 1, [d[n] + "_tp2" for n in HYBRID], [trained[n] for n in HYBRID]),
              (1, 2, [d[n] + "_tp1" for n in HYBRID], [None] * len(HYBRID))]
    ranks = run_distributed(_world_fn, 2, phases, tokens, timeout=600)
    ours = [next(r[i] for r in ranks if r[i] is not None) for i in range(len(ranks[0]))]
    names = ([f"{n}_tp1" for n in HYBRID] + [x for n in HYBRID for x in (f"{n}_tp2", f"{n}_trained")] +
             [f"{n}_pp2" for n in HYBRID])
    return dict(dirs=d, root=root, tokens=tokens, ref=ref, trained=trained, ours=dict(zip(names, ours)))


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_logits_match_hf(world, family):
    for layout in ("_tp1", "_tp2", "_pp2"):
        assert max_rel_err(world["ours"][family + layout], world["ref"][family]) <= RTOL, layout


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_export_round_trip_is_bitwise(world, family):
    """TP=2 checkpoint -> HF: the very tensors we imported (the fused in_proj / conv1d put back together)."""
    from megatron.training.checkpointing.hf import export_hf_checkpoint
    src, out = world["dirs"][family], str(world["root"] / f"{family}_back")
    export_hf_checkpoint(src + "_tp2", out)
    orig, back = safetensors_in(src), safetensors_in(out)
    assert sorted(orig) == sorted(back)
    for k in orig:
        assert torch.equal(orig[k], back[k]), k


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_trained_checkpoint_loads_in_transformers(world, family, tmp_path):
    """Weights moved and saved under TP=2; transformers reproduces our logits from the export, also when the
    family is inferred from the args alone (no hf_config.json next to the checkpoint)."""
    from transformers import AutoModelForCausalLM

    from megatron.training.checkpointing.hf import export_hf_checkpoint
    ours = world["ours"][f"{family}_trained"]
    assert max_rel_err(ours, world["ref"][family]) > 1e-3  # the weights did move
    for hf_config in (True, False):
        out = str(tmp_path / f"{family}_{hf_config}")
        if not hf_config:  # the trained run's --load (the import, with its hf_config.json) hidden
            os.rename(os.path.join(world["dirs"][family] + "_tp2", "hf_config.json"), str(tmp_path / "hidden"))
        try:
            export_hf_checkpoint(world["trained"][family], out)
        finally:
            if not hf_config:
                os.rename(str(tmp_path / "hidden"), os.path.join(world["dirs"][family] + "_tp2", "hf_config.json"))
        assert json.load(open(os.path.join(out, "config.json")))["architectures"][0].lower().startswith(
            family.replace("_", ""))
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        assert max_rel_err(ours, _hf_logits(model, world["tokens"])) <= RTOL, hf_config


def test_hybrid_flags_and_bad_configs(world):
    """model_args.sh holds the pattern and the Mamba shapes; HF configs we cannot reproduce are one line."""
    from megatron.core.hf import UnsupportedConfig, mamba2, nemotron_h
    text = open(os.path.join(world["dirs"]["nemotron_h"] + "_tp1", "model_args.sh")).read()
    for flag in ("--hybrid-layer-pattern 'M*-M*-'", "--squared-relu", "--position-embedding-type none",
                 "--mamba-num-heads 8", "--mamba-state-dim 8", "--mamba-num-groups 2", "--num-query-groups 2"):
        assert flag in text, flag
    m2 = _hybrid_configs()["mamba2"].to_dict()
    nh = _hybrid_configs()["nemotron_h"].to_dict()
    assert nemotron_h.pattern(dict(nh, layers_block_type=None, hybrid_override_pattern="M-*")) == "M-*"
    for family, cfg, text in (
            (mamba2, dict(m2, time_step_limit=[0.0, 1.0]), "time_step_limit [0.0, 1.0]"),
            (mamba2, dict(m2, use_conv_bias=False), "use_conv_bias=false"),
            (mamba2, dict(m2, layer_norm_epsilon=1e-6), "layer_norm_epsilon 1e-06"),
            (nemotron_h, dict(nh, layers_block_type=["linear_attention", "moe"]), "MoE layers are not converted"),
            (nemotron_h, dict(nh, mlp_hidden_act="silu"), "mlp_hidden_act 'silu'")):
        with pytest.raises(UnsupportedConfig, match=text.replace("[", r"\[").replace("]", r"\]")):
            family.config_to_flags(cfg)

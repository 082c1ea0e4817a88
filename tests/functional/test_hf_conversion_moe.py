"""Mixtral and Qwen3-MoE <-> our checkpoints, proven by logits; the bad-input lines of every family.

Tiny random HF models (fp32, CPU): Mixtral with a sliding window and renormalised top-2 routing, Qwen3-MoE
with QK-norm, a dense layer (mlp_only_layers) and norm_topk_prob=false (--moe-router-pre-softmax). Each is
imported with SequentialMLP experts at TP=1 and TP=2 x PP=2, and with --moe-grouped-gemm (GroupedMLP) at
TP=2 x EP=2 (one of them through each command-line spelling). ONE spawned 4-rank gloo world loads them under
TP=1 (4 replicas), TP=2 x PP=2 and TP=2 x EP=2; in the last phase it also moves every weight (a stand-in for
training) and saves, so export is checked on weights that are not the imported ones.
"""
import glob
import json
import os
import shutil
import zlib

import pytest
import torch

pytest.importorskip("transformers")

from tests.fixtures.hf_checks import max_rel_err, safetensors_in  # noqa: E402
from tests.functional.test_hf_conversion import (  # noqa: E402
    SEQ,
    VOCAB,
    _build_hf,
    _cli,
    _hf_configs,
    _hf_logits,
    forward_logits,
    load_ours,
)
from tests.parallel.dist_utils import run_distributed  # noqa: E402

# fp32 on CPU, same operations as transformers in another order (TP/PP/EP splits, expert loops vs grouped
# tensors): measured ~3e-7 relative. Routing is discrete, so the router weights are drawn large enough that no
# token's top-k is within rounding of a tie; the wrong router semantics (pre-softmax or not) moves them 3e-3.
RTOL = 1e-5
MOE = ["mixtral", "qwen3_moe"]


def _moe_configs():
    from transformers import MixtralConfig, Qwen3MoeConfig
    common = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False, num_experts_per_tok=2,
                  router_aux_loss_coef=0.01)
    return {
        "mixtral": MixtralConfig(**common, intermediate_size=16, num_hidden_layers=2, num_local_experts=4,
                                 sliding_window=7),
        "qwen3_moe": Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
                                    num_experts=4, head_dim=16, mlp_only_layers=[1], norm_topk_prob=False),
    }


def _build_moe(cfg, path):
    model = _build_hf(cfg, path)
    with torch.no_grad():  # large router weights: top-k far from ties (see RTOL)
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return model


def _perturb(model):
    """Move every weight by a small amount seeded by its name (same on every rank holding it)."""
    with torch.no_grad():
        for chunk in model:
            for name, p in chunk.named_parameters():
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def _world_fn(phases, tokens):
    """Per phase (tp, pp, ep, checkpoints, save_dirs): logits of each checkpoint; with a save dir, then
    the logits after `_perturb` and a save there."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training.checkpointing import save_checkpoint
    out = []
    for tp, pp, ep, ckpts, saves in phases:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep)
        model_parallel_cuda_manual_seed(1)
        for ckpt, save in zip(ckpts, saves):
            extra = ("--save", save, "--save-interval", "1", "--no-save-optim", "--no-save-rng") if save else ()
            model = load_ours(ckpt, tp, pp, ep, extra)
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
    root = tmp_path_factory.mktemp("hfmoe")
    d = {name: str(root / name) for name in MOE}
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ref = {}
    for name, cfg in _moe_configs().items():
        ref[name] = _hf_logits(_build_moe(cfg, d[name]), tokens)
        import_hf_checkpoint(d[name], d[name] + "_tp1")
        import_hf_checkpoint(d[name], d[name] + "_tp2pp2", tp=2, pp=2)
    # Grouped-GEMM experts through both command-line spellings.
    _cli("hf.py", "import", "--hf-model-path", d["mixtral"], "--output-path", d["mixtral"] + "_grouped",
         "--tp", "2", "--ep", "2", "--moe-grouped-gemm")
    _cli("convert.py", "--model-type", "GPT", "--loader", "hf", "--saver", "core", "--load-dir", d["qwen3_moe"],
         "--save-dir", d["qwen3_moe"] + "_grouped", "--target-tensor-parallel-size", "2",
         "--target-expert-parallel-size", "2", "--moe-grouped-gemm")
    trained = {n: str(root / f"{n}_trained") for n in MOE}
    phases = [(1, 1, 1, [d[n] + "_tp1" for n in MOE], [None] * 2),
              (2, 2, 1, [d[n] + s for s in ("_tp2pp2", "_grouped") for n in MOE], [None] * 4),
              (2, 1, 2, [d["mixtral"] + "_tp2pp2", d["qwen3_moe"] + "_grouped"], [trained[n] for n in MOE])]
    ranks = run_distributed(_world_fn, 4, phases, tokens, timeout=600)
    ours = [next(r[i] for r in ranks if r[i] is not None) for i in range(len(ranks[0]))]
    names = ([f"{n}_tp1" for n in MOE] + [f"{n}{s}_tp2pp2" for s in ("", "_grouped") for n in MOE] +
             ["mixtral_ep2", "mixtral_trained", "qwen3_moe_grouped_ep2", "qwen3_moe_trained"])
    return dict(dirs=d, root=root, tokens=tokens, ref=ref, trained=trained, ours=dict(zip(names, ours)))


@pytest.mark.parametrize("family", MOE)
def test_moe_logits_match_hf(world, family):
    ours, ref = world["ours"], world["ref"][family]
    for layout in ("_tp1", "_tp2pp2", "_grouped_tp2pp2", "_ep2" if family == "mixtral" else "_grouped_ep2"):
        assert max_rel_err(ours[family + layout], ref) <= RTOL, layout


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("experts", ["_tp2pp2", "_grouped"])
def test_moe_export_round_trip_is_bitwise(world, family, experts):
    """SequentialMLP and GroupedMLP checkpoints -> HF: the very tensors we imported."""
    from megatron.training.checkpointing.hf import export_hf_checkpoint
    src, out = world["dirs"][family], str(world["root"] / f"{family}{experts}_back")
    export_hf_checkpoint(src + experts, out)
    orig, back = safetensors_in(src), safetensors_in(out)
    assert sorted(orig) == sorted(back)
    for k in orig:
        assert torch.equal(orig[k], back[k]), k


@pytest.mark.parametrize("family", MOE)
def test_moe_trained_checkpoint_loads_in_transformers(world, family):
    """Weights moved and saved under TP=2 x EP=2; transformers reproduces our logits from the export."""
    from transformers import AutoModelForCausalLM

    from megatron.training.checkpointing.hf import export_hf_checkpoint
    out = str(world["root"] / f"{family}_trained_hf")
    export_hf_checkpoint(world["trained"][family], out)
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ours = world["ours"][f"{family}_trained"]
    assert max_rel_err(ours, world["ref"][family]) > 1e-3  # the weights did move
    assert max_rel_err(ours, _hf_logits(model, world["tokens"])) <= RTOL


def test_moe_flags_rebuild_the_architecture(world):
    """model_args.sh parses to the args stored for --use-checkpoint-args; exported config.json matches."""
    from megatron.core.hf import FAMILIES
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing.args import read_checkpoint_args
    src = world["dirs"]["qwen3_moe"]
    text = open(os.path.join(src + "_grouped", "model_args.sh")).read()
    for flag in ("--moe-layer-freq '[1,0,1,1]'", "--moe-router-pre-softmax", "--moe-ffn-hidden-size 16",
                 "--ffn-hidden-size 48", "--qk-layernorm", "--num-experts 4", "--moe-grouped-gemm"):
        assert flag in text, flag
    argv = [a.strip("'") for line in text.split("MODEL_ARGS=(")[1].split(")")[0].split("\n") for a in line.split()]
    flags = parse_args(argv=argv)
    saved, _ = read_checkpoint_args(src + "_grouped")
    for name in ("num_experts", "moe_layer_freq", "moe_router_topk", "moe_router_pre_softmax", "moe_ffn_hidden_size",
                 "moe_grouped_gemm", "qk_layernorm", "ffn_hidden_size", "kv_channels", "num_query_groups"):
        assert getattr(flags, name) == getattr(saved, name), name
    assert saved.expert_model_parallel_size == 2 and saved.tensor_model_parallel_size == 2
    cfg = FAMILIES["qwen3_moe"].args_to_config(saved, VOCAB)  # no source config: from the args alone
    hf = json.load(open(os.path.join(src, "config.json")))
    assert cfg["mlp_only_layers"] == [1] and cfg["norm_topk_prob"] is False
    for k in ("moe_intermediate_size", "intermediate_size", "num_experts_per_tok", "head_dim", "hidden_size"):
        assert cfg[k] == hf[k], k
    mix = open(os.path.join(world["dirs"]["mixtral"] + "_tp1", "model_args.sh")).read()
    assert "--window-size 6,0" in mix and "--moe-router-pre-softmax" not in mix and "--moe-layer-freq" not in mix
    mix_args, _ = read_checkpoint_args(world["dirs"]["mixtral"] + "_tp1")
    cfg = FAMILIES["mixtral"].args_to_config(mix_args, VOCAB)
    hf = json.load(open(os.path.join(world["dirs"]["mixtral"], "config.json")))
    for k in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "sliding_window",
              "router_aux_loss_coef"):
        assert cfg[k] == hf[k], k
    with pytest.raises(ValueError, match="no Mixtral counterpart"):  # dense layers, pre-softmax routing
        FAMILIES["mixtral"].args_to_config(saved, VOCAB)


def test_qwen3_moe_layer_pattern_matches_transformers():
    """decoder_sparse_step / mlp_only_layers -> --moe-layer-freq list, layer by layer as transformers builds it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megatron.core.hf import UnsupportedConfig, qwen3_moe
    cfg = Qwen3MoeConfig(vocab_size=8, hidden_size=8, intermediate_size=8, moe_intermediate_size=4, num_hidden_layers=6,
                         num_attention_heads=2, num_key_value_heads=1, num_experts=2, num_experts_per_tok=1,
                         decoder_sparse_step=2, mlp_only_layers=[3])
    hf = [int(type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock") for layer in Qwen3MoeForCausalLM(cfg).model.layers]
    assert qwen3_moe.layer_pattern(cfg.to_dict()) == hf == [0, 1, 0, 0, 0, 1]
    flags = dict(qwen3_moe.config_to_flags(dict(cfg.to_dict(), norm_topk_prob=True)))
    assert flags["--moe-layer-freq"] == "[0,1,0,0,0,1]" and "--moe-router-pre-softmax" not in flags
    for bad, text in (({"decoder_sparse_step": 0}, "decoder_sparse_step 0 is not supported"),
                      ({"mlp_only_layers": [1, 3, 5]}, "without MoE layers")):
        with pytest.raises(UnsupportedConfig, match=text):
            qwen3_moe.layer_pattern(dict(cfg.to_dict(), **bad))


# One config.json edit per family that changes a weight's shape without changing the tensor names.
_SHAPE_EDITS = {"gpt2": {"n_inner": 64}, "llama31": {"intermediate_size": 48}, "mistral": {"intermediate_size": 48},
                "qwen2": {"intermediate_size": 48}, "qwen3": {"head_dim": 8}, "mixtral": {"intermediate_size": 8},
                "qwen3_moe": {"moe_intermediate_size": 8}, "deepseek_v3": {"kv_lora_rank": 8}}


def test_bad_inputs_of_every_family(world, tmp_path):
    """Unsupported architecture, missing shard, shape vs config.json, TP vs heads / KV groups, EP vs experts:
    one line each, for every family."""
    from megatron.core.hf import UnsupportedConfig
    from megatron.training.checkpointing.hf import import_hf_checkpoint
    from tests.unit.core.hf.test_deepseek_v3 import _hf_model as deepseek_model
    dirs = dict(world["dirs"])
    for name, cfg in _hf_configs().items():
        dirs[name] = str(tmp_path / name)
        _build_hf(cfg, dirs[name])
    dirs["deepseek_v3"] = str(tmp_path / "deepseek_v3")
    deepseek_model().save_pretrained(dirs["deepseek_v3"])

    def expect(hf_dir, exc, text, **kw):
        with pytest.raises(exc) as e:
            import_hf_checkpoint(hf_dir, str(tmp_path / "out"), **kw)
        msg = str(e.value.args[0])
        assert text in msg and "\n" not in msg, msg

    def copy(family, what, edit=None):
        dst = str(tmp_path / f"{family}_{what}")
        shutil.copytree(dirs[family], dst)
        cfg = json.load(open(os.path.join(dst, "config.json")))
        json.dump(dict(cfg, **(edit or {})), open(os.path.join(dst, "config.json"), "w"))
        return dst

    supported = ("supported: DeepseekV3ForCausalLM, GPT2LMHeadModel, LlamaForCausalLM, LlavaForConditionalGeneration, "
                 "Mamba2ForCausalLM, "
                 "MistralForCausalLM, MixtralForCausalLM, NemotronHForCausalLM, Qwen2ForCausalLM, "
                 "Qwen2_5_VLForConditionalGeneration, Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen3NextForCausalLM")
    for family in _SHAPE_EDITS:
        expect(copy(family, "arch", {"architectures": ["FalconForCausalLM"]}), UnsupportedConfig,
               f"architecture FalconForCausalLM is not supported; {supported}")
        # an index naming a second shard that is not there
        shard = copy(family, "shard")
        names = list(safetensors_in(shard))
        index = {"weight_map": {n: "model-00001-of-00002.safetensors" for n in names}}
        index["weight_map"][names[0]] = "model-00002-of-00002.safetensors"
        os.replace(os.path.join(shard, "model.safetensors"), os.path.join(shard, "model-00001-of-00002.safetensors"))
        json.dump(index, open(os.path.join(shard, "model.safetensors.index.json"), "w"))
        expect(shard, FileNotFoundError, "model-00002-of-00002.safetensors is missing (listed in")
        expect(copy(family, "shape", _SHAPE_EDITS[family]), ValueError, "do not match config.json (expected")
        expect(dirs[family], ValueError, "--tp 3 must divide the attention heads (4) and KV groups", tp=3)
        if json.load(open(os.path.join(dirs[family], "config.json"))).get("num_key_value_heads") == 2:
            expect(dirs[family], ValueError, "--tp 4 must divide the attention heads (4) and KV groups (2)", tp=4)
        if family in ("mixtral", "qwen3_moe", "deepseek_v3"):
            experts = 8 if family == "deepseek_v3" else 4
            expect(dirs[family], ValueError, f"--ep 3 must divide the number of experts ({experts})", ep=3)
            expect(dirs[family], ValueError, "--ep 2 with the torch format is not supported", ep=2, fmt="torch")
        else:
            expect(dirs[family], ValueError, "needs a mixture-of-experts model", ep=2)
            expect(dirs[family], ValueError, "--moe-grouped-gemm: ", moe_grouped_gemm=True)
    with pytest.raises(SystemExit) as e:  # the command lines print the same line
        _cli("convert.py", "--loader", "mixtral_hf", "--saver", "core", "--load-dir", dirs["mixtral"],
             "--save-dir", str(tmp_path / "cli"), "--target-expert-parallel-size", "3")
    assert str(e.value) == "error: --ep 3 must divide the number of experts (4)"
    assert not glob.glob(str(tmp_path / "out" / "*"))  # nothing written by a refused import

"""Checkpoints interchange with Megatron-LM itself (dense GPT, MoE, MLA): Megatron Core 0.19.2 (its pip wheel, local
layer spec, CPU, gloo, fp32) saves a torch_dist checkpoint that our GPTModel loads, at the same TP and at another,
with logits equal; our `dist_checkpointing.save_in_megatron_layout` writes one that Megatron's GPTModel loads, with
logits equal.

Megatron runs in a subprocess (tests/functional/mcore_checkpoint_side.py) whose sys.path starts with the wheel's
files and holds no part of this checkout, so its ``megatron`` package never meets ours. The wheel needs
Python >= 3.12 to ``pip install``, so it is unpacked instead (docs/migrating.md, "Bring your checkpoint"):

    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 -d /tmp/mcore_whl megatron-core==0.19.2
    python -m zipfile -e /tmp/mcore_whl/megatron_core-0.19.2-*.whl /tmp/mcore_site
    python -m pip install --no-deps --target /tmp/mcore_site psutil

``MCORE_SITE`` names another directory; without one holding megatron-core 0.19.2 the tests are skipped.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from tests.parallel.dist_utils import run_distributed

HERE = os.path.dirname(os.path.abspath(__file__))
SIDE = os.path.join(HERE, "mcore_checkpoint_side.py")
MCORE_SITE = os.environ.get("MCORE_SITE", "/tmp/mcore_site")
BATCH, SEQ = 2, 16  # as in mcore_checkpoint_side.py
# fp32 on CPU, the same operations in both frameworks: only summation order differs (measured up to ~1.5e-6
# relative at init std 0.5).
RTOL = 1e-5

pytestmark = pytest.mark.skipif(
    not os.path.isdir(os.path.join(MCORE_SITE, "megatron_core-0.19.2.dist-info")),
    reason=f"Megatron Core 0.19.2 is not unpacked at MCORE_SITE={MCORE_SITE}; see this module's docstring")

# Every config initializes with std 0.5, not 0.02: at 0.02 the attention scores are ~1e-3, the softmax is nearly
# uniform whatever q and k are, and a wrong query/key layout would move the logits by only ~1e-5.
STD = {"init_method_std": 0.5}
# Llama-style: SwiGLU (fc1 saved as Megatron's [2f, h]), RMSNorm, GQA, RoPE, no biases, tied embeddings.
LLAMA = {"vocab_size": 128, "config": {**STD, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                       "num_query_groups": 2, "ffn_hidden_size": 96, "gated_linear_unit": True,
                                       "activation": "silu", "normalization": "RMSNorm", "add_bias_linear": False},
         "model": {"position_embedding_type": "rope", "share_embeddings_and_output_weights": True}}
# GPT-2-style: GeLU, LayerNorm with biases, learned positions, untied output layer.
GPT2 = {"vocab_size": 96, "config": {**STD, "num_layers": 3, "hidden_size": 32, "num_attention_heads": 4},
        "model": {"share_embeddings_and_output_weights": False}, "seed": 7}
# MoE, 4 experts top-2, SwiGLU. Megatron's local spec always builds sequential experts (grouped GEMM needs TE);
# ours with grouped experts ([E, out, in] weights) or sequential ones.
_MOE = {**STD, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_moe_experts": 4, "moe_router_topk": 2,
        "ffn_hidden_size": 48, "gated_linear_unit": True, "activation": "silu", "add_bias_linear": False}
MOE_GROUPED = {"vocab_size": 64, "config": {**_MOE, "moe_grouped_gemm": True}, "seed": 3}
MOE_SEQUENTIAL = {"vocab_size": 64, "config": _MOE, "seed": 5}
# DeepSeek-style multi-latent attention (q and kv low rank, YaRN rope; Megatron keeps its norm names here).
MLA = {"vocab_size": 64, "config": {**STD, "multi_latent_attention": True, "num_layers": 2, "hidden_size": 32,
                                    "num_attention_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 8, "qk_head_dim": 8,
                                    "qk_pos_emb_head_dim": 4, "v_head_dim": 8, "add_bias_linear": False,
                                    "normalization": "RMSNorm"},
       "model": {"position_embedding_type": "rope"}, "seed": 11}


def megatron(jobs, tmp_path) -> list:
    """Megatron Core's side in its own interpreter: each job ``(mode, cfg, ckpt_dir, tp)`` saves or loads
    ``ckpt_dir`` at ``tp``, in order, in one set of ranks; each job's logits [b, s, V]."""
    specs = [{"mode": mode, "cfg": cfg, "ckpt_dir": ckpt, "tp": tp,
              "out": str(tmp_path / f"mcore_{mode}_{i}_{os.path.basename(ckpt)}_tp{tp}.pt")}
             for i, (mode, cfg, ckpt, tp) in enumerate(jobs)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = MCORE_SITE
    proc = subprocess.run([sys.executable, "-W", "ignore", SIDE, json.dumps(specs)],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"Megatron Core failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [torch.load(spec["out"]) for spec in specs]


def _our_model(cfg: dict, tp: int, pp: int = 1) -> GPTModel:
    fields = dict(cfg["config"])
    if fields.pop("activation", "gelu") == "silu":
        fields["activation_func"] = torch.nn.functional.silu
    mla = fields.pop("multi_latent_attention", False)
    config = (MLATransformerConfig if mla else TransformerConfig)(
        **fields, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, hidden_dropout=0.0,
        attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(num_experts=fields.get("num_moe_experts"),
                                    moe_grouped_gemm=fields.get("moe_grouped_gemm", False),
                                    normalization=fields.get("normalization", "LayerNorm"), multi_latent_attention=mla)
    return GPTModel(config, spec, cfg["vocab_size"], SEQ, pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(), **cfg.get("model", {}))


def _logits(model: GPTModel, vocab: int):
    """[b, s, V] on the last pipeline stage (None on the others): the stages' activations passed on by hand."""
    tok = (torch.arange(BATCH * SEQ).view(BATCH, SEQ) * 7 + 3) % vocab
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    model.eval()
    with torch.no_grad():
        if not parallel_state.is_pipeline_first_stage():
            received = torch.empty(SEQ, BATCH, model.config.hidden_size)  # [s, b, h]
            torch.distributed.recv(received, group=pp_group, group_src=pp_rank - 1)
            model.set_input_tensor(received)
        out = model(tok, torch.arange(SEQ).expand(BATCH, SEQ), mask)
    if not parallel_state.is_pipeline_last_stage():
        torch.distributed.send(out.contiguous(), group=pp_group, group_dst=pp_rank + 1)
        return None
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def ours_load(cfg: dict, ckpt_dir: str, tp: int, pp: int = 1):
    """On each rank: our GPTModel at ``tp`` x ``pp`` loads ``ckpt_dir`` with Megatron's API calls; its logits."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = _our_model(cfg, tp, pp)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
    return _logits(model, cfg["vocab_size"])


def ours_save(cfg: dict, ckpt_dir: str, tp: int):
    """On each rank: a fresh GPTModel at ``tp`` saved in Megatron's layout; its logits."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(cfg.get("seed", 0))
    model = _our_model(cfg, tp)
    dist_checkpointing.save_in_megatron_layout(model.sharded_state_dict(), ckpt_dir, model.config.num_layers,
                                               model.config.num_moe_experts)
    return _logits(model, cfg["vocab_size"])


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


# Megatron saves, ours loads: (config, the TP Megatron saves at, the (TP, PP) layouts ours loads at: the saved
# layout, then others; TP=2 -> TP=1 x PP=2 splits the layer axis by stage).
MEGATRON_SAVES = {"llama_tp2": (LLAMA, 2, ((2, 1), (1, 1), (1, 2))), "gpt2_tp1": (GPT2, 1, ((1, 1), (2, 1))),
                  "moe_tp2": (MOE_GROUPED, 2, ((2, 1), (1, 1))), "mla_tp2": (MLA, 2, ((2, 1), (1, 1)))}
# Ours saves, Megatron loads: (config, the TP ours saves at, the TP Megatron loads at).
OURS_SAVES = {"llama_tp2": (LLAMA, 2, 1), "gpt2_tp1": (GPT2, 1, 2), "moe_tp2": (MOE_SEQUENTIAL, 2, 1),
              "mla_tp1": (MLA, 1, 2)}


@pytest.fixture(scope="module")
def megatron_saved(tmp_path_factory):
    """Every MEGATRON_SAVES checkpoint, saved by one Megatron interpreter: name -> (directory, its logits)."""
    tmp = tmp_path_factory.mktemp("megatron_saves")
    names = list(MEGATRON_SAVES)
    dirs = [str(tmp / f"mcore_ckpt_{name}") for name in names]
    logits = megatron([("save", MEGATRON_SAVES[n][0], d, MEGATRON_SAVES[n][1]) for n, d in zip(names, dirs)], tmp)
    return dict(zip(names, zip(dirs, logits)))


@pytest.fixture(scope="module")
def megatron_loaded(tmp_path_factory):
    """Every OURS_SAVES checkpoint saved by ours, then loaded by one Megatron interpreter: name -> (our logits,
    Megatron's)."""
    tmp = tmp_path_factory.mktemp("our_saves")
    ours, jobs = {}, []
    for name, (cfg, saved_tp, loaded_tp) in OURS_SAVES.items():
        ckpt = str(tmp / f"our_ckpt_{name}")
        ours[name] = run_distributed(ours_save, saved_tp, cfg, ckpt, saved_tp)[0]
        jobs.append(("load", cfg, ckpt, loaded_tp))
    return {name: (ours[name], theirs) for name, theirs in zip(ours, megatron(jobs, tmp))}


@pytest.mark.parametrize("name", list(MEGATRON_SAVES))
def test_megatron_saves_ours_loads(megatron_saved, name):
    cfg, saved_tp, loaded = MEGATRON_SAVES[name]
    ckpt, reference = megatron_saved[name]
    for tp, pp in loaded:
        ours = run_distributed(ours_load, tp * pp, cfg, ckpt, tp, pp)[-1]
        assert _close(ours, reference) < RTOL, f"TP={saved_tp} -> TP={tp} x PP={pp}"


@pytest.mark.parametrize("name", list(OURS_SAVES))
def test_ours_saves_megatron_loads(megatron_loaded, name):
    _, saved_tp, loaded_tp = OURS_SAVES[name]
    ours, theirs = megatron_loaded[name]
    assert _close(ours, theirs) < RTOL, f"TP={saved_tp} -> Megatron at TP={loaded_tp}"

"""Hugging Face <-> our checkpoints, proven by logits, per family (GPT-2, Llama 3.1, Mistral, Qwen2, Qwen3).

One module fixture does the expensive part once: tiny random HF models (fp32, CPU), their logits on a
fixed batch, imports at TP=1 and TP=2 x PP=2 (torch_dist, plus one torch-format import through
convert.py), a 2-iteration CLI run from an import, and ONE spawned 4-rank gloo world that loads every
checkpoint with our model under TP=1 (as 4 data-parallel replicas), then TP=2 x PP=2 (and the torch-format
import under its own TP=2 layout).
"""
import glob
import json
import os
import runpy
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from tests.fixtures.hf_checks import max_rel_err, randomize_vectors, safetensors_in
from tests.parallel.dist_utils import run_distributed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB, SEQ = 200, 24
# fp32 on CPU with the same operations as transformers: only summation order differs (TP/PP splits the
# matmuls), measured ~3e-7 relative; 1e-5 still catches a wrong RoPE scaling (4e-5 here) or window.
RTOL = 1e-5
FAMILIES = ["gpt2", "llama31", "mistral", "qwen2", "qwen3"]


def _hf_configs():
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8192)
    return {
        "gpt2": GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                           attn_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0),
        "llama31": LlamaConfig(**common, max_position_embeddings=131072, tie_word_embeddings=False, head_dim=16,
                               rope_scaling=llama3, rope_theta=500000.0),
        # window 7 < SEQ: the band mask is exercised
        "mistral": MistralConfig(**common, max_position_embeddings=64, sliding_window=7, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**common, max_position_embeddings=64, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**common, max_position_embeddings=64, head_dim=16, tie_word_embeddings=False),
    }


def _build_hf(cfg, path, shard=None):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    randomize_vectors(model, norm_markers=("norm", "ln"))
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def load_ours(ckpt, tp, pp, ep=1, extra=()):
    """Our model chunks (eval mode) on this rank, loaded the way a training run does (--use-checkpoint-args)."""
    import pretrain_gpt
    import pretrain_hybrid
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.checkpointing.args import load_args_from_checkpoint
    from megatron.training.global_vars import set_args
    from megatron.training.model_setup import get_model
    args = parse_args(argv=["--load", ckpt, "--use-checkpoint-args", "--micro-batch-size", "2",
                            "--seq-length", str(SEQ), "--tensor-model-parallel-size", str(tp),
                            "--pipeline-model-parallel-size", str(pp), "--expert-model-parallel-size", str(ep),
                            "--lr", "0", "--train-iters", "1", "--mock-data", "--exit-on-missing-checkpoint",
                            "--auto-detect-ckpt-format", *extra])
    args.rank, args.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    load_args_from_checkpoint(args)
    set_args(validate_args(args))
    provider = pretrain_hybrid if args.is_hybrid_model else pretrain_gpt
    model = get_model(provider.model_provider, wrap_with_ddp=False)
    load_checkpoint(model, None, None)
    for chunk in model:
        chunk.eval()  # dropout off (--use-checkpoint-args does not carry dropout rates)
    return model


def forward_logits(model, tokens):
    """Full-vocab logits on the last stage's TP rank 0, None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    def step(data, model):
        toks = next(data)
        out = model(toks, torch.arange(toks.shape[1]).expand_as(toks), None)
        return out, lambda o, non_loss_data=False: gather_from_tensor_model_parallel_region(o)

    out = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter([tokens]), model=model, num_microbatches=1,
        seq_length=SEQ, micro_batch_size=tokens.shape[0], forward_only=True, collect_non_loss_data=True)
    last = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    return out[0][..., :VOCAB].detach().clone() if last and out else None


def our_logits(phases, tokens):
    """On each rank: for each (tp, pp, checkpoints) phase, load every checkpoint and return the full-vocab
    logits of the last stage (None elsewhere)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    results = []
    for tp, pp, ckpts in phases:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        model_parallel_cuda_manual_seed(1)
        for ckpt in ckpts:
            results.append(forward_logits(load_ours(ckpt, tp, pp), tokens))
        ps.destroy_model_parallel()
    return results


def _run(*cmd):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable] + list(cmd), capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def _cli(tool, *argv):
    """A tools/checkpoint command line, run in this process (it spawns its own ranks where it needs them)."""
    return runpy.run_path(os.path.join(ROOT, "tools", "checkpoint", tool))["main"](list(argv))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from megatron.training.checkpointing.hf import import_hf_checkpoint
    root = tmp_path_factory.mktemp("hf")
    d = {name: str(root / name) for name in FAMILIES}
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ref = {}
    for name, cfg in _hf_configs().items():
        # llama31 is saved in several shards: the reader follows model.safetensors.index.json
        ref[name] = _hf_logits(_build_hf(cfg, d[name], shard="20KB" if name == "llama31" else None), tokens)
        import_hf_checkpoint(d[name], d[name] + "_tp1")
        import_hf_checkpoint(d[name], d[name] + "_tp2pp2", tp=2, pp=2)
    # Megatron's spelling (its main(), in this process), legacy torch format: one file per TP rank,
    # written by spawned ranks.
    _cli("convert.py", "--model-type", "GPT", "--loader", "llama_mistral", "--saver", "core",
         "--load-dir", d["llama31"], "--save-dir", d["llama31"] + "_torch", "--target-format", "torch",
         "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "1")
    # Continued training from an import, through the CLI, loading the TP=2 x PP=2 files under TP=1.
    trained = str(root / "trained")
    _run("pretrain_gpt.py", "--load", d["qwen3"] + "_tp2pp2", "--use-checkpoint-args",
         "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--seq-length", str(SEQ),
         "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-2",
         "--mock-data", "--eval-iters", "0", "--num-workers", "0", "--save", trained, "--save-interval", "2")
    tp1 = [d[n] + "_tp1" for n in FAMILIES] + [trained]
    tp2pp2 = [d[n] + "_tp2pp2" for n in FAMILIES]
    ranks = run_distributed(our_logits, 4, [(1, 1, tp1), (2, 2, tp2pp2), (2, 1, [d["llama31"] + "_torch"])],
                            tokens, timeout=600)
    ours = [next(r[i] for r in ranks if r[i] is not None) for i in range(len(tp1) + len(tp2pp2) + 1)]
    return dict(dirs=d, root=root, tokens=tokens, ref=ref, trained=trained,
                tp1=dict(zip(FAMILIES + ["trained"], ours[:len(tp1)])),
                tp2pp2=dict(zip(FAMILIES, ours[len(tp1):-1])), torch_tp2=ours[-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf(world, family):
    assert max_rel_err(world["tp1"][family], world["ref"][family]) <= RTOL
    assert max_rel_err(world["tp2pp2"][family], world["ref"][family]) <= RTOL


def test_torch_format_import_matches_hf(world):
    """Legacy torch format: one file per TP rank, loaded under that layout (TP=2 x DP=2)."""
    assert max_rel_err(world["torch_tp2"], world["ref"]["llama31"]) <= RTOL


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_is_bitwise(world, family):
    """TP=2 x PP=2 checkpoint -> HF: the very tensors we imported (vocab padding stripped)."""
    from megatron.training.checkpointing.hf import export_hf_checkpoint
    src, out = world["dirs"][family], str(world["root"] / f"{family}_back")
    export_hf_checkpoint(src + "_tp2pp2", out, max_shard_bytes=20_000 if family == "qwen2" else 5 * 2 ** 30)
    orig, back = safetensors_in(src), safetensors_in(out)
    assert sorted(orig) == sorted(back)
    for k in orig:
        assert torch.equal(orig[k], back[k]), k
    cfg_o, cfg_b = (json.load(open(os.path.join(p, "config.json"))) for p in (src, out))
    assert cfg_b["architectures"] == cfg_o["architectures"] and cfg_b["vocab_size"] == VOCAB
    if family == "qwen2":
        assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))


def test_torch_format_export_cli(world):
    """Bridge's spelling from the legacy per-rank files (rewritten as torch_dist on spawned ranks first)."""
    src, out = world["dirs"]["llama31"], str(world["root"] / "llama31_from_torch")
    _cli("hf.py", "export", "--checkpoint-path", src + "_torch", "--output-path", out)
    orig, back = safetensors_in(src), safetensors_in(out)
    assert sorted(orig) == sorted(back) and all(torch.equal(orig[k], back[k]) for k in orig)


def test_trained_checkpoint_loads_in_transformers(world):
    """After 2 training iterations the weights moved; transformers reproduces our logits from the export."""
    from transformers import AutoModelForCausalLM

    from megatron.training.checkpointing.hf import export_hf_checkpoint
    out = str(world["root"] / "trained_hf")
    export_hf_checkpoint(world["trained"], out, max_shard_bytes=20_000)  # transformers follows the index
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    hf = _hf_logits(model, world["tokens"])
    assert max_rel_err(world["tp1"]["trained"], world["ref"]["qwen3"]) > 1e-3  # training changed the model
    assert max_rel_err(world["tp1"]["trained"], hf) <= RTOL


def test_import_writes_flags_and_args(world):
    from megatron.training.checkpointing.args import read_checkpoint_args
    out = world["dirs"]["mistral"] + "_tp2pp2"
    flags = open(os.path.join(out, "model_args.sh")).read()
    assert "--window-size 6,0" in flags and "--swiglu" in flags and "--num-query-groups 2" in flags
    args, it = read_checkpoint_args(out)
    assert it == 0 and args.window_size == (6, 0) and args.tensor_model_parallel_size == 2
    assert args.padded_vocab_size == 256 and args.vocab_size == VOCAB  # 200 padded to a multiple of 128 x TP


def test_bad_inputs_fail_with_one_line(world, tmp_path):
    from megatron.core.hf import UnsupportedConfig
    from megatron.training.checkpointing.hf import import_hf_checkpoint
    src = world["dirs"]["llama31"]

    def copy(name, edit=None, drop=None):
        dst = str(tmp_path / name)
        shutil.copytree(src, dst)
        if edit:
            cfg = json.load(open(os.path.join(dst, "config.json")))
            cfg.update(edit)
            json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
        if drop:
            os.remove(os.path.join(dst, drop))
        return dst

    falcon = copy("arch", {"architectures": ["FalconForCausalLM"]})
    cases = [
        (falcon, {}, UnsupportedConfig,
         "architecture FalconForCausalLM is not supported; supported: DeepseekV3ForCausalLM, GPT2LMHeadModel, "
         "LlamaForCausalLM"),
        (copy("shard", drop=sorted(glob.glob(os.path.join(src, "model-*.safetensors")))[1].rsplit("/", 1)[1]), {},
         FileNotFoundError, "is missing (listed in"),
        (copy("shape", {"intermediate_size": 48}), {}, ValueError, "do not match config.json"),
        (src, {"tp": 3}, ValueError, "--tp 3 must divide the attention heads (4) and KV groups (2)"),
        (copy("rope", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}), {},
         UnsupportedConfig, "rope scaling type 'yarn' is not supported"),
    ]
    for hf_dir, kw, exc, text in cases:
        with pytest.raises(exc) as e:
            import_hf_checkpoint(hf_dir, str(tmp_path / "out"), **kw)
        msg = str(e.value.args[0])
        assert text in msg and "\n" not in msg, msg
    with pytest.raises(SystemExit) as e:  # the CLI prints the same line
        _cli("hf.py", "import", "--hf-model-path", falcon, "--output-path", str(tmp_path / "cli"))
    assert str(e.value).startswith("error: config.json: architecture FalconForCausalLM is not supported")


def test_window_size_flag_and_mask():
    from megatron.core.transformer.dot_product_attention import sliding_window_mask
    from megatron.training.arguments import parse_args
    assert parse_args(argv=["--window-size", "4095,0"]).window_size == (4095, 0)
    assert parse_args(argv=["--window-size", "(3, -1)"]).window_size == (3, -1)
    # query i sees keys i-1..i: HF sliding_window=2
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(sliding_window_mask(4, 4, (1, 0), "cpu"), expected)


def test_llama31_rope_frequencies_match_transformers():
    """Our --use-rope-scaling frequencies at Llama-3.1-8B's head size equal transformers' bitwise."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, max_position_embeddings=131072,
                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=8192))
    hf, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = RotaryEmbedding(128, 1.0, rotary_base=500000, rope_scaling=True, rope_scaling_factor=8.0,
                           use_cpu_initialization=True).inv_freq
    plain = RotaryEmbedding(128, 1.0, rotary_base=500000, use_cpu_initialization=True).inv_freq
    assert torch.equal(ours, hf) and not torch.equal(plain, hf)


def test_rope_frequencies_stay_fp32_under_bf16():
    """Float16Module casts the model to bf16; a bf16 inv_freq would rotate position 4096 by radians too much."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    rope = RotaryEmbedding(128, 1.0, rotary_base=500000, use_cpu_initialization=True)
    ref = rope(4096)
    rope = rope.to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(rope(4096), ref)


def test_layouts_invert_and_group_qkv_per_kv_head():
    """Fused QKV rows are [q of group g; k_g; v_g] per group; every transform inverts exactly."""
    from megatron.core.hf.layout import CONV1D_QKV, GATE_UP, QKV, VOCAB, Dims
    d = Dims(num_heads=4, num_groups=2, head_dim=3, vocab_size=5, padded_vocab_size=8)
    q, k, v = (torch.randn(n * 3, 6) for n in (4, 2, 2))
    fused = QKV.to_ours([q, k, v], d)
    assert torch.equal(fused[:6], q[:6]) and torch.equal(fused[6:9], k[:3]) and torch.equal(fused[9:12], v[:3])
    assert all(torch.equal(a, b) for a, b in zip(QKV.to_hf(fused, d), (q, k, v)))
    gate, up = torch.randn(7, 6), torch.randn(7, 6)
    assert all(torch.equal(a, b) for a, b in zip(GATE_UP.to_hf(GATE_UP.to_ours([gate, up], d), d), (gate, up)))
    emb = torch.randn(5, 6)
    padded = VOCAB.to_ours([emb], d)
    assert padded.shape == (8, 6) and not padded[5:].any() and torch.equal(VOCAB.to_hf(padded, d)[0], emb)
    assert torch.equal(VOCAB.to_hf(emb[:4], d)[0][:4], emb[:4])  # a model with fewer rows: zero rows added
    mha = Dims(2, 2, 3, 5, 8)  # GPT-2's c_attn: Conv1D [h, 3h] with q | k | v columns
    c_attn = torch.randn(6, 18)
    assert torch.equal(CONV1D_QKV.to_hf(CONV1D_QKV.to_ours([c_attn], mha), mha)[0], c_attn)

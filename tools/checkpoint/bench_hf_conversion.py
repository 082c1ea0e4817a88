"""Benchmark Hugging Face conversion on a Llama-3-8B-shaped model (GPU machine).

    python tools/checkpoint/bench_hf_conversion.py --work-dir /tmp/hfbench [--num-layers 32]

1. builds a random Llama-3.1-8B-shaped LlamaForCausalLM in transformers (bf16, on the GPU when there is
   one) and saves it (safetensors, 5 GB shards); its logits on a fixed batch are the reference;
2. imports it to TP=2 x PP=2 torch_dist (tools/checkpoint/hf.py in a child process) and exports it back;
   wall time and the child's peak host RSS (resource.getrusage) for each;
3. checks the exported tensors are bitwise equal to the originals (streamed, one tensor at a time);
4. loads the TP=2 x PP=2 checkpoint with our model under TP=1 on one GPU (bf16) and compares logits.
Prints one JSON line with the measurements.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


_PEAK = ("import resource, runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], "
         "run_name='__main__')\nfinally:\n    "
         "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")


def _child(cmd):
    """Run a conversion CLI in a child process; (seconds, that child's peak RSS in GiB)."""
    t = time.time()
    p = subprocess.run([sys.executable, "-c", _PEAK] + cmd, cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT})
    if p.returncode != 0:
        raise SystemExit(p.stdout[-2000:] + p.stderr[-2000:])
    kib = int(p.stdout.rsplit("PEAK_RSS_KIB", 1)[1].split()[0])
    return round(time.time() - t, 1), round(kib / 2 ** 20, 2)


def build_hf(path, layers, device, tiny=False):
    from transformers import LlamaConfig, LlamaForCausalLM
    shape = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8)
    if tiny:  # a smoke test of this script on CPU
        shape = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=2)
    cfg = LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000,
                      eos_token_id=128001,
                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_max_position_embeddings=8192))
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(path, max_shard_size="5GB")
    return model


def our_logits(ckpt, tokens):
    """Our model on one device (TP=PP=1, bf16) from the TP=2 x PP=2 checkpoint."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend, rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.checkpointing.args import load_args_from_checkpoint
    from megatron.training.global_vars import set_args
    from megatron.training.model_setup import get_model
    from pretrain_gpt import model_provider
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    args = parse_args(argv=["--load", ckpt, "--use-checkpoint-args", "--micro-batch-size", "1", "--bf16",
                            "--seq-length", str(tokens.shape[1]), "--tensor-model-parallel-size", "1",
                            "--pipeline-model-parallel-size", "1", "--lr", "0", "--train-iters", "1", "--mock-data",
                            "--exit-on-missing-checkpoint"])
    load_args_from_checkpoint(args)
    set_args(validate_args(args))
    model = get_model(model_provider, wrap_with_ddp=False)
    load_checkpoint(model, None, None)
    model[0].eval()  # no dropout (--use-checkpoint-args does not carry dropout rates)
    device = next(model[0].parameters()).device
    toks = tokens.to(device)
    with torch.no_grad():
        out = model[0](toks, torch.arange(toks.shape[1], device=device).expand_as(toks), None)
    return out.float().cpu()


def compare_bitwise(a_dir, b_dir):
    """Every tensor of ``a_dir`` equals ``b_dir``'s, read one at a time."""
    from megatron.core.hf.safetensors_io import SafetensorsReader
    a, b = SafetensorsReader(a_dir), SafetensorsReader(b_dir)
    return sorted(a.weight_map) == sorted(b.weight_map) and all(
        torch.equal(a.get(name), b.get(name)) for name in a.weight_map)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", default="/tmp/hf_bench")
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--tiny", action="store_true", help="Hidden 256, vocab 1000: a quick CPU check of the script.")
    o = p.parse_args()
    hf_dir, ckpt, back = (os.path.join(o.work_dir, n) for n in ("hf", "ours_tp2pp2", "hf_back"))
    shutil.rmtree(o.work_dir, ignore_errors=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = {"layers": o.num_layers, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    t = time.time()
    hf = build_hf(hf_dir, o.num_layers, device, o.tiny)
    res["build_and_save_s"] = round(time.time() - t, 1)
    print("progress", json.dumps(res), flush=True)
    tokens = torch.randint(0, 1000 if o.tiny else 128000, (1, o.seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(tokens.to(device)).logits.float().cpu()
        # bf16's own error: the same HF model run in fp32 is the yardstick for "within bf16 tolerance".
        ref32 = hf.float()(tokens.to(device)).logits.float().cpu()
    del hf
    torch.cuda.empty_cache() if device == "cuda" else None
    res["import_s"], res["import_peak_rss_gib"] = _child(
        ["tools/checkpoint/hf.py", "import", "--hf-model-path", hf_dir, "--output-path", ckpt,
         "--tp", "2", "--pp", "2"])
    res["export_s"], res["export_peak_rss_gib"] = _child(
        ["tools/checkpoint/hf.py", "export", "--checkpoint-path", ckpt, "--output-path", back])
    print("progress", json.dumps(res), flush=True)
    res["hf_size_gib"] = round(sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir)) / 2 ** 30, 2)
    res["round_trip_bitwise"] = compare_bitwise(hf_dir, back)
    print("progress", json.dumps(res), flush=True)
    ours = our_logits(ckpt, tokens)[..., :ref.shape[-1]]
    diff = (ours - ref).abs()
    res.update(logits_max_abs_diff=round(diff.max().item(), 4), logits_mean_abs_diff=round(diff.mean().item(), 5),
               logits_max_abs=round(ref.abs().max().item(), 3),
               argmax_agreement=round((ours.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4),
               hf_bf16_vs_fp32_mean_abs_diff=round((ref - ref32).abs().mean().item(), 5),
               ours_bf16_vs_hf_fp32_mean_abs_diff=round((ours - ref32).abs().mean().item(), 5),
               hf_bf16_argmax_agreement_with_fp32=round((ref.argmax(-1) == ref32.argmax(-1)).float().mean().item(), 4),
               ours_argmax_agreement_with_fp32=round((ours.argmax(-1) == ref32.argmax(-1)).float().mean().item(), 4))
    res["ru_maxrss_self_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)
    print(json.dumps(res))


if __name__ == "__main__":
    main()

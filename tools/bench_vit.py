"""ViT classification training throughput: our VitClassificationModel through the training stack (bf16
parameters in Float16Module, DDP's fp32 gradient buffer, Megatron's Adam with fp32 main weights, the
pipeline schedule) next to timm's ``vit_large_patch16_224`` training step (bf16 autocast, fused AdamW) on
the same GPU, same shapes and batch.

    pip install timm        # optional: without it only our model is measured
    python tools/bench_vit.py                                  # ViT-L/16, 224 px, batch 64
    python tools/bench_vit.py --batch 128 --compile            # both models under torch.compile
    python tools/bench_vit.py --cuda-graph                     # ours replayed as one graph a step
    python tools/bench_vit.py --layers 2 --hidden 64 --heads 4 --ffn 256 --batch 4 --device cpu --dtype fp32

Prints, per implementation, ms/step, images/s, TFLOP/s and MFU against the device's dense bf16 peak
(megatron/training/flops.py). FLOPs per image (training = 3 x forward, matmuls only): per layer and token
2 * (4h^2 + 2hf) for the QKV / output / MLP GEMMs + 4sh for non-causal attention (QK^T and AV), over
s = patches + 1 tokens and L layers, plus the patch embedding and the head.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron.training.flops import current_device_name, dense_bf16_peak  # noqa: E402


def parse_cli(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--img", type=int, default=224)
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--batch", type=int, default=64, help="Images per training step.")
    p.add_argument("--steps", type=int, default=20, help="Timed steps (after --warmup).")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--impl", choices=["ours", "timm", "both"], default="both")
    p.add_argument("--compile", action="store_true", help="torch.compile each model before timing.")
    p.add_argument("--cuda-graph", action="store_true",
                   help="ours: forward and backward of the step replayed as one CUDA graph, as pretrain's "
                        "--cuda-graph-impl full_iteration does (the optimizer step stays eager); timm as usual.")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="After timing, profile 3 steps of each and print its N most expensive kernels (device time).")
    return p.parse_args(argv)


def flops_per_image(a) -> float:
    """Training FLOPs of one image (3 x the forward's matmul FLOPs)."""
    patches = (a.img // a.patch) ** 2
    s, h, f = patches + 1, a.hidden, a.ffn
    layers = a.layers * s * (2 * (4 * h * h + 2 * h * f) + 4 * s * h)
    embed = 2 * patches * (3 * a.patch * a.patch) * h
    head = 2 * (h * h + h * a.classes)  # timm's head is one linear; ours adds dense_in (the legacy MLP head)
    return 3.0 * (layers + embed + head)


def _init_single_process(device, graph_safe_rng: bool = False):
    """A one-rank process group and model-parallel state, so our layers run as in a 1-GPU pretrain."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # a bare "cuda" device has no index
    parallel_state.initialize_model_parallel(1)
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=graph_safe_rng)


def _config_as_pretrain(a, device):
    """The TransformerConfig that ``pretrain_vision_classify.py`` builds from the same flags: Megatron's flag
    defaults switch on the fusions users get (bias + GeLU, bias + dropout + add, weight-gradient accumulation
    into main_grad), which a bare TransformerConfig leaves off."""
    from megatron.training.arguments import core_transformer_config_from_args, parse_args
    from megatron.training.arguments.validation import validate_args
    from megatron.training.arguments.vision_args import add_vision_classify_args
    from pretrain_vision_classify import vit_defaults

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    flags = (f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads {a.heads} "
             f"--ffn-hidden-size {a.ffn} --img-h {a.img} --img-w {a.img} --patch-dim {a.patch} "
             f"--num-classes {a.classes} --micro-batch-size {a.batch} --global-batch-size {a.batch} "
             "--attention-dropout 0 --hidden-dropout 0 --lr 1e-4 --train-iters 1 --mock-data").split()
    flags += ["--bf16"] if a.dtype == "bf16" else []
    flags += ["--use-cpu-initialization"] if device.type == "cpu" else []
    args = validate_args(parse_args(add_vision_classify_args, argv=flags), vit_defaults(flags))
    return core_transformer_config_from_args(args)


def ours_step(a, device):
    """A step function training VitClassificationModel the way pretrain_vision_classify.py does."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.vision.vit_classification_model import VitClassificationModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    if a.cuda_graph and device.type != "cuda":
        raise SystemExit("--cuda-graph needs a CUDA device")
    _init_single_process(device, graph_safe_rng=a.cuda_graph)
    bf16 = a.dtype == "bf16"
    config = _config_as_pretrain(a, device)
    model = VitClassificationModel(config, get_vit_layer_with_local_spec(), a.classes, img_h=a.img, img_w=a.img,
                                   patch_dim=a.patch)
    if bf16:
        model = Float16Module(config, model)
    if a.compile:
        model.module = torch.compile(model.module) if bf16 else torch.compile(model)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-4, weight_decay=0.05, bf16=bf16, clip_grad=1.0), [model])
    images = torch.randn(a.batch, 3, a.img, a.img, device=device)
    labels = torch.randint(0, a.classes, (a.batch,), device=device)
    seq = (a.img // a.patch) ** 2 + 1
    # Made once: a host-to-device copy per step would also be illegal inside a captured graph.
    count, report_zeros = torch.tensor(a.batch, device=device, dtype=torch.int), torch.zeros(2, device=device)
    forward_backward = get_forward_backward_func()
    if a.cuda_graph:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper  # lazy: CUDA-only option
        forward_backward = FullCudaGraphWrapper(forward_backward, cuda_graph_warmup_steps=3)

    def forward_step(data_iterator, m):
        x, y = next(data_iterator)
        return m(x), lambda logits: (F.cross_entropy(logits.float(), y, reduction="sum"), count,
                                     {"loss": report_zeros})

    def step():
        model.zero_grad_buffer()
        opt.zero_grad()
        forward_backward(forward_step_func=forward_step, data_iterator=iter([(images, labels)]),
                         model=[model], num_microbatches=1, seq_length=seq, micro_batch_size=a.batch,
                         forward_only=False)
        finalize_model_grads([model])
        ok, _, _ = opt.step()
        assert ok, "the optimizer skipped the step"
    return step


def timm_step(a, device):
    """timm's ViT training step (as its train.py with --amp): fp32 weights, bf16 autocast, fused AdamW."""
    try:
        import timm  # lazy: optional; only this comparison needs it
    except ImportError:
        return None
    model = timm.create_model("vit_large_patch16_224", pretrained=False, img_size=a.img, patch_size=a.patch,
                              embed_dim=a.hidden, depth=a.layers, num_heads=a.heads, mlp_ratio=a.ffn / a.hidden,
                              num_classes=a.classes).to(device)
    if a.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=device.type == "cuda")
    images = torch.randn(a.batch, 3, a.img, a.img, device=device)
    labels = torch.randint(0, a.classes, (a.batch,), device=device)
    amp = a.dtype == "bf16"

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(images).float(), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return step


def measure(step, a, device) -> float:
    """Median seconds per step over ``a.steps`` steps after ``a.warmup``."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile(step, name, a, device) -> None:
    """The ``a.profile`` kernels with the most device time over 3 steps: where one implementation's step goes."""
    from torch.profiler import ProfilerActivity
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"--- {name}: top {a.profile} of 3 steps by device time", flush=True)
    print(prof.key_averages().table(sort_by=sort, row_limit=a.profile, max_name_column_width=70), flush=True)


def report(name, seconds, a, device_name) -> str:
    tflops = flops_per_image(a) * a.batch / seconds / 1e12
    peak = dense_bf16_peak(device_name)
    mfu = f"{100 * tflops / peak:.1f}%" if peak else "n/a"
    return (f"{name}: {seconds * 1e3:.1f} ms/step, {a.batch / seconds:.1f} images/s, {tflops:.1f} TFLOP/s, "
            f"MFU {mfu} ({device_name})")


def main(argv=None):
    a = parse_cli(argv)
    device = torch.device(a.device)
    name = current_device_name() if device.type == "cuda" else "cpu"
    mode = (", compiled" if a.compile else "") + (", ours as one CUDA graph" if a.cuda_graph else "")
    print(f"ViT {a.layers}x{a.hidden} (heads {a.heads}, ffn {a.ffn}), {a.img}px / {a.patch}, batch {a.batch}, "
          f"{a.dtype}{mode}: {flops_per_image(a) / 1e9:.1f} GFLOP per image (training)", flush=True)
    results = {}
    if a.impl in ("ours", "both"):
        step = ours_step(a, device)
        results["ours"] = measure(step, a, device)
        print(report("ours", results["ours"], a, name), flush=True)
        if a.profile:
            profile(step, "ours", a, device)
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if a.impl in ("timm", "both"):
        step = timm_step(a, device)
        if step is None:
            print("timm: not installed (pip install timm) - skipped", flush=True)
        else:
            results["timm"] = measure(step, a, device)
            print(report("timm", results["timm"], a, name), flush=True)
            if a.profile:
                profile(step, "timm", a, device)
    if len(results) == 2:
        print(f"ours / timm images/s: {results['timm'] / results['ours']:.2f}x", flush=True)
    return results


if __name__ == "__main__":
    main()

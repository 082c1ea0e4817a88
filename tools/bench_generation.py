"""Generation benchmark: our engine vs transformers' generate on the same weights, and the server.

    python tools/bench_generation.py --out gen.json          # Llama-3-8B shape, bf16, one GPU, ~6-9 min
    python tools/bench_generation.py --decode-only           # batch-1 / small-batch decode only, ~2-3 min
    python tools/bench_generation.py --tiny                  # a seconds-long smoke run (CPU or GPU)

Measures (prompt 128 tokens, 128 new tokens, greedy, random weights):
- batch-1 decode ms/token and its memory-bandwidth bound: bytes every step must read (all weights but
  the embedding table, plus the KV cache at the mean context) / the device-to-device copy bandwidth
  measured here (bytes read + written per second);
- batch-32 decode tokens/s, prefill tokens/s (batch 1 and 32);
- transformers' generate on a LlamaForCausalLM holding the same weights (dynamic and static cache);
- the REST server: aggregate generated tokens/s of 16 concurrent clients vs one client;
- batch-1 and small-batch decode three ways: CUDA graphs (the default), eager, and torch.compile + graphs
  (last: it compiles), with a kernel profile of one eager and one compiled step.
Each result prints as soon as it is measured, so a cut-short run still reports what it finished.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

LLAMA3_8B = dict(layers=32, hidden=4096, ffn=14336, heads=32, groups=8, vocab=128256, theta=500000.0)
TINY = dict(layers=2, hidden=64, ffn=128, heads=4, groups=2, vocab=512, theta=10000.0)
RESULTS = {}


OUT = None  # --out: rewritten after every result, so a run cut short keeps what it measured


def report(key, value, note=""):
    RESULTS[key] = value
    if OUT:
        with open(OUT, "w") as f:
            json.dump(RESULTS, f, indent=1)
    print(f"{key:<44} {value:>12.2f}  {note}" if isinstance(value, float) else f"{key:<44} {value}  {note}",
          flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_model(shape, device, dtype):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(num_layers=shape["layers"], hidden_size=shape["hidden"], ffn_hidden_size=shape["ffn"],
                            num_attention_heads=shape["heads"], num_query_groups=shape["groups"],
                            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=False, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                            bias_activation_fusion=True,  # --bias-swiglu-fusion, on by default in Megatron
                            perform_initialization=False, use_cpu_initialization=device.type == "cpu")
    model = GPTModel(cfg, get_gpt_layer_local_spec(), shape["vocab"], 8192, position_embedding_type="rope",
                     rotary_base=shape["theta"], share_embeddings_and_output_weights=False)
    model = model.to(device=device, dtype=dtype).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():  # random weights, drawn on the device (seconds for 8B parameters)
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def to_hf(model, shape, device, dtype):
    """A transformers LlamaForCausalLM holding ``model``'s weights (fused QKV / fc1 split per group)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    h, nh, ng = shape["hidden"], shape["heads"], shape["groups"]
    hn, rep = h // nh, nh // ng
    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=h, intermediate_size=shape["ffn"],
                      num_hidden_layers=shape["layers"], num_attention_heads=nh, num_key_value_heads=ng,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      attention_bias=False, mlp_bias=False)
    if hasattr(cfg, "rope_parameters") and isinstance(cfg.rope_parameters, dict):
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": shape["theta"]}
    cfg.rope_theta = shape["theta"]
    cfg._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: an fp32 8B model would need 32 GB more
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    ours = model.state_dict()
    sd = {"model.embed_tokens.weight": ours["embedding.word_embeddings.weight"],
          "model.norm.weight": ours["decoder.final_layernorm.weight"], "lm_head.weight": ours["output_layer.weight"]}
    for i in range(shape["layers"]):
        o, t = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = ours[o + "self_attention.linear_qkv.weight"].view(ng, rep + 2, hn, h)  # per group: q.., k, v
        sd[t + "self_attn.q_proj.weight"] = qkv[:, :rep].reshape(nh * hn, h)
        sd[t + "self_attn.k_proj.weight"] = qkv[:, rep].reshape(ng * hn, h)
        sd[t + "self_attn.v_proj.weight"] = qkv[:, rep + 1].reshape(ng * hn, h)
        sd[t + "self_attn.o_proj.weight"] = ours[o + "self_attention.linear_proj.weight"]
        gate, up = ours[o + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        sd[t + "mlp.gate_proj.weight"], sd[t + "mlp.up_proj.weight"] = gate, up
        sd[t + "mlp.down_proj.weight"] = ours[o + "mlp.linear_fc2.weight"]
        sd[t + "input_layernorm.weight"] = ours[o + "input_layernorm.weight"]
        sd[t + "post_attention_layernorm.weight"] = ours[o + "pre_mlp_layernorm.weight"]
    hf.load_state_dict(sd, strict=True)
    return hf


def copy_bandwidth(device, gib=2.0):
    """Device-to-device copy: (bytes read + bytes written) per second."""
    n = int(gib * 2 ** 30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    iters = 20 if device.type == "cuda" else 2
    t = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * 2 * iters / (time.perf_counter() - t)


def timed(fn, device, repeat=1):
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def bench_engine(engine, prompts, new, device, tag):
    """(prefill s, decode s per step) from a 1-token and an ``new``-token greedy run (after warm-up)."""
    from megatron.core.inference import SamplingParams
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=new)
    engine.generate(prompts, greedy)  # warm-up: graph captures / compiles for these shapes
    t_first = timed(lambda: engine.generate(prompts, SamplingParams(top_k=1, num_tokens_to_generate=1)), device, 3)
    t_all = timed(lambda: engine.generate(prompts, greedy), device, 2)
    b = len(prompts)
    step = (t_all - t_first) / (new - 1)
    report(f"{tag} b{b} prefill tokens/s", b * len(prompts[0]) / t_first)
    report(f"{tag} b{b} decode ms/step", step * 1e3)
    report(f"{tag} b{b} decode tokens/s", b / step)
    return t_first, step


def bench_hf(hf, prompts, new, device, cache, tag):
    ids = torch.tensor(prompts, device=device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(ids))
    if cache == "static":
        kw["cache_implementation"] = "static"

    def run(n):
        with torch.inference_mode():
            return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
    run(new)  # warm-up (the static cache compiles its decode step here)
    t_first = timed(lambda: run(1), device, 2)
    t_all = timed(lambda: run(new), device, 1)
    b = len(prompts)
    step = (t_all - t_first) / (new - 1)
    if cache == "dynamic":
        report(f"{tag} b{b} prefill tokens/s", b * len(prompts[0]) / t_first)
    report(f"{tag} b{b} decode ms/step", step * 1e3)
    report(f"{tag} b{b} decode tokens/s", b / step)
    return run(8)[:, ids.shape[1]:].tolist()


def bench_server(engine, vocab, args):
    """Aggregate tokens/s of N concurrent clients (a separate process) against the real server."""
    from megatron.inference.scheduler import GenerationScheduler
    from megatron.inference.text_generation_server import MegatronServer
    from megatron.training.tokenizer.bpe_tokenizers import _NullTokenizer
    from tests.parallel.dist_utils import free_port
    scheduler = GenerationScheduler(engine)
    server = MegatronServer(scheduler, _NullTokenizer(vocab), {"temperature": 1.0, "top_k": 1, "top_p": 0.0})
    port = free_port()
    server.start("127.0.0.1", port)
    device = engine.device

    def loop():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        scheduler.run()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def clients(n, per_client):
        cmd = [sys.executable, os.path.abspath(__file__), "--client", f"http://127.0.0.1:{port}", "--clients",
               str(n), "--requests-per-client", str(per_client), "--prompt-len", str(args.prompt_len),
               "--new-tokens", str(args.new_tokens), "--vocab", str(vocab)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        return json.loads(out.stdout.strip().splitlines()[-1])
    try:
        clients(args.clients, 1)  # warm-up: captures the decode graphs of every batch bucket
        one = clients(1, 3)
        many = clients(args.clients, 2)
    finally:
        server.shutdown()
        thread.join(timeout=60)
    report("server 1 client tokens/s", one["tokens"] / one["seconds"])
    report(f"server {args.clients} clients tokens/s", many["tokens"] / many["seconds"])
    report(f"server {args.clients} clients / 1 client", (many["tokens"] / many["seconds"]) /
           (one["tokens"] / one["seconds"]), "(target >= 8)")


def run_clients(args):
    """--client mode: N threads, each sending its requests one after another; prints JSON totals."""
    import random
    import urllib.request
    total = [0] * args.clients

    def client(i):
        rng = random.Random(i)
        for _ in range(args.requests_per_client):
            prompt = " ".join(str(rng.randrange(args.vocab - 1)) for _ in range(args.prompt_len))
            body = json.dumps({"prompts": [prompt], "tokens_to_generate": args.new_tokens, "top_k": 1}).encode()
            req = urllib.request.Request(args.client + "/api", data=body, method="PUT",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as resp:
                total[i] += len(json.loads(resp.read())["tokens"][0]) - args.prompt_len
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    print(json.dumps({"tokens": sum(total), "seconds": time.perf_counter() - t}))


def kernel_profile(engine, device, batch, kv_len, tag, steps=3):
    """The kernels of ``engine``'s decode step (eager, or compiled when the engine compiles) at this graph
    bucket: per step, how many and their summed device time, and the costliest. Graph replay ms minus
    this sum is what launch gaps still cost; eager ms minus it is the host's share."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with torch.inference_mode():
        engine._step_fn(batch, kv_len, True)  # warm (a compiled step compiles here if it has not yet)
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine._step_fn(batch, kv_len, True)
            sync(device)
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    def time_of(e):  # us; the attribute's name changed across torch versions
        return max(getattr(e, a, 0) or 0 for a in ("self_device_time_total", "device_time_total"))
    report(f"{tag} b{batch} kernels per step", sum(e.count for e in kernels) / steps)
    report(f"{tag} b{batch} kernel time ms/step", sum(time_of(e) for e in kernels) / steps / 1e3)
    for e in sorted(kernels, key=time_of, reverse=True)[:8]:
        print(f"    {time_of(e) / steps:9.1f} us/step {e.count / steps:6.1f} x  {e.key[:90]}", flush=True)


def bench_decode(model, shape, prompts, args, device, bound, batches, with_graphs=True):
    """Batch-1 and small-batch decode with CUDA graphs, without (eager), and compiled before capture."""
    from megatron.core.inference import InferenceEngine
    from megatron.core.inference.cuda_graphs import bucket
    variants = [("ours", {}, batches)] if with_graphs else []
    variants.append(("ours eager", {"use_cuda_graphs": False}, batches))
    if "compile" not in args.skip and device.type == "cuda":  # batch 1 and batch >= 2 are two compiles
        variants.append(("ours+compile", {"compile_decode": True}, batches if args.compile_small_batch else [1]))
    max_len = args.prompt_len + args.new_tokens
    kv_len = bucket(max_len, max_len, minimum=64)  # the KV bucket of the last steps (the graph shape)
    for tag, kw, sizes in variants:
        t = time.perf_counter()
        engine = InferenceEngine(model, max_batch_size=max(batches), max_sequence_length=max_len,
                                 vocab_size=shape["vocab"], **kw)
        for b in sizes:
            _, step = bench_engine(engine, prompts[:b], args.new_tokens, device, tag)
            report(f"{tag} b{b} % of bandwidth bound", 100 * bound(b) / step, "(target >= 75)" if b == 1 else "")
        if "compile" in kw:
            report("ours+compile fell back to eager", int(engine._step_fn.fell_back))
        if device.type == "cuda" and "profile" not in args.skip and tag != "ours":  # graphs replay eager's kernels
            kernel_profile(engine, device, 1, kv_len, tag)
        report(f"{tag} seconds (with captures / compiles)", time.perf_counter() - t)
        del engine


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model smoke run")
    p.add_argument("--layers", type=int, default=None,
                   help="fewer layers than the Llama-3-8B shape (faster compiles); the bound is this model's")
    p.add_argument("--decode-only", action="store_true",
                   help="only batch-1 / small-batch decode: graphs, eager, compiled, with the bound (~3 min)")
    p.add_argument("--small-batch", type=int, default=8, help="the small batch measured beside batch 1")
    p.add_argument("--compile-small-batch", action="store_true",
                   help="the compiled step at the small batch too (a second compile, ~1 more minute)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--skip", nargs="*", default=[], choices=["hf", "hf-static", "server", "compile", "profile"])
    p.add_argument("--out", type=str, default=None, help="write the results as JSON here")
    p.add_argument("--client", type=str, default=None, help=argparse.SUPPRESS)
    p.add_argument("--requests-per-client", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        return run_clients(args)
    global OUT
    OUT = args.out
    from megatron.core.inference import InferenceEngine, SamplingParams
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    start = time.perf_counter()
    shape = dict(TINY if args.tiny else LLAMA3_8B)
    if args.layers is not None:
        shape["layers"] = args.layers
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_parallel_cuda_manual_seed(0)
    model = build_model(shape, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e9:.2f}B parameters, {shape['layers']} layers, {dtype}, {device}"
          f" ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), torch {torch.__version__}")
    bw = copy_bandwidth(device, 0.0625 if args.tiny else 2.0)
    report("copy bandwidth GB/s (read+write)", bw / 1e9)
    elem = torch.finfo(dtype).bits // 8
    weights = (n_params - model.embedding.word_embeddings.weight.numel()) * elem
    kv_per_token = shape["layers"] * 2 * shape["groups"] * (shape["hidden"] // shape["heads"]) * elem
    ctx = args.prompt_len + args.new_tokens / 2  # mean context over the decode steps

    def bound(b):  # seconds per decode step: every weight once, each sequence's KV cache once
        return (weights + kv_per_token * ctx * b) / bw
    report("b1 bound ms/step (bytes read / copy bw)", bound(1) * 1e3, f"{(weights + kv_per_token * ctx) / 1e9:.2f} GB")
    max_len = args.prompt_len + args.new_tokens
    gen = torch.Generator().manual_seed(1)
    n_prompts = max(args.batch, args.small_batch)
    prompts = torch.randint(0, shape["vocab"] - 1, (n_prompts, args.prompt_len), generator=gen).tolist()
    if args.decode_only:
        bench_decode(model, shape, prompts, args, device, bound, [1, args.small_batch])
        report("total seconds", time.perf_counter() - start)
        return
    engine = InferenceEngine(model, max_batch_size=max(args.batch, args.clients), max_sequence_length=max_len,
                             vocab_size=shape["vocab"])
    _, step1 = bench_engine(engine, prompts[:1], args.new_tokens, device, "ours")
    report("ours b1 % of bandwidth bound", 100 * bound(1) / step1, "(target >= 75)")
    _, step_s = bench_engine(engine, prompts[:args.small_batch], args.new_tokens, device, "ours")
    report(f"ours b{args.small_batch} % of bandwidth bound", 100 * bound(args.small_batch) / step_s)
    _, step_b = bench_engine(engine, prompts[:args.batch], args.new_tokens, device, "ours")
    report(f"ours b{args.batch} % of bandwidth bound", 100 * bound(args.batch) / step_b)
    ours_tokens = engine.generate(prompts[:1], SamplingParams(top_k=1, num_tokens_to_generate=8))[0].generated_tokens
    if "server" not in args.skip:
        bench_server(engine, shape["vocab"], args)
    del engine
    if "hf" not in args.skip:
        import transformers
        hf = to_hf(model, shape, device, dtype)
        print(f"transformers {transformers.__version__}", flush=True)
        hf_tokens = bench_hf(hf, prompts[:1], args.new_tokens, device, "dynamic", "hf dynamic")
        report("greedy tokens equal to transformers (of 8)", sum(a == b for a, b in zip(ours_tokens, hf_tokens[0])))
        bench_hf(hf, prompts[:args.batch], args.new_tokens, device, "dynamic", "hf dynamic")
        if "hf-static" not in args.skip:
            bench_hf(hf, prompts[:1], args.new_tokens, device, "static", "hf static")
            bench_hf(hf, prompts[:args.batch], args.new_tokens, device, "static", "hf static")
            key = f"hf static b{args.batch} decode tokens/s"
            report(f"ours / hf static b{args.batch} decode", RESULTS[f"ours b{args.batch} decode tokens/s"] /
                   RESULTS[key], "(target >= 1.5)")
        report("ours / hf b1 prefill", RESULTS["ours b1 prefill tokens/s"] / RESULTS["hf dynamic b1 prefill tokens/s"],
               "(target >= 1)")
        del hf
    bench_decode(model, shape, prompts, args, device, bound, [1, args.small_batch], with_graphs=False)
    report("total seconds", time.perf_counter() - start)


if __name__ == "__main__":
    main()

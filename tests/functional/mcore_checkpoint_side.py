"""Megatron Core's side of tests/functional/test_megatron_checkpoints.py: run by that test in a subprocess whose
sys.path starts with the megatron-core 0.19.2 wheel's files and does not hold our checkout (cwd elsewhere).

    python mcore_checkpoint_side.py JOBS_JSON

JOBS_JSON is a list of jobs ``{"mode": "save"|"load", "cfg": ..., "ckpt_dir": ..., "out": ..., "tp": N}``. For each,
in order, Megatron's GPTModel with its local layer spec is built on CPU (gloo, fp32, use_cpu_initialization) at
TP=N (the other ranks of the largest TP's world data parallel), then either saves ``model.sharded_state_dict()``
with ``dist_checkpointing.save`` (torch_dist) or loads the checkpoint into it, and the full-vocabulary logits of a
fixed batch go to ``out``. One interpreter and one set of ranks serve all jobs: importing Megatron Core costs
seconds per process.

Megatron Core 0.19.2 needs four CPU patches here, each the smallest found (all in this script, none in ours):
- ``megatron.core.transformer.moe.ops.paged_stash`` imports triton unconditionally (pulled in by
  ``megatron.core.pipeline_parallel.schedules``): a stand-in module with its three names;
- the RNG tracker's ``fork()`` needs CUDA RNG states (``model_parallel_cuda_manual_seed`` calls
  ``torch.cuda.get_rng_state``): ``fork`` becomes a no-op context (dropout is 0);
- the torch_dist save calls ``torch.cuda.synchronize()`` and builds a tensor on
  ``torch.cuda.current_device()``: a no-op and ``'cpu'``;
- ``get_default_causal_mask`` builds the mask on ``'cuda'``: the batch passes its own causal mask.
Its multi-latent attention spec also needs a core attention that takes ``k_channels`` (TE's): SDPA here.
The save also needs psutil importable (installed next to the wheel).
"""
import contextlib
import json
import os
import socket
import sys
import types

import torch
import torch.distributed as dist

_STUB = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
_STUB.GLOBAL_BLOCK_SIZE, _STUB.paged_stash_copy_kernel, _STUB.paged_stash_pop_kernel = 1024, None, None
sys.modules[_STUB.__name__] = _STUB
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402  (after the stand-in above)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig  # noqa: E402

BATCH, SEQ = 2, 16


def tokens(vocab: int) -> torch.Tensor:
    """The fixed batch both sides compute logits on."""
    return (torch.arange(BATCH * SEQ).view(BATCH, SEQ) * 7 + 3) % vocab


class SDPACoreAttention(torch.nn.Module):
    """Causal core attention through torch SDPA: Megatron's local DotProductAttention refuses the multi-latent
    attention spec's ``k_channels`` (its MLA needs Transformer Engine); core attention holds no weights."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, **kwargs):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        sq, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def build(cfg: dict, tp: int):
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    fields = dict(cfg["config"])
    if fields.pop("activation", "gelu") == "silu":
        fields["activation_func"] = torch.nn.functional.silu
    mla = fields.pop("multi_latent_attention", False)
    config = (MLATransformerConfig if mla else TransformerConfig)(
        **fields, tensor_model_parallel_size=tp, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(num_experts=fields.get("num_moe_experts"),
                                    moe_grouped_gemm=fields.get("moe_grouped_gemm", False),
                                    normalization=fields.get("normalization", "LayerNorm"),
                                    qk_layernorm=fields.get("qk_layernorm", False), multi_latent_attention=mla)
    if mla:
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg["vocab_size"],
                    max_sequence_length=SEQ, **cfg.get("model", {}))


def logits(model, vocab: int) -> torch.Tensor:
    """[b, s, V] on every rank (the TP ranks' vocab slices gathered)."""
    tok = tokens(vocab)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    model.eval()
    with torch.no_grad():
        out = model(tok, pos, mask)
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def run_job(job: dict, rank: int):
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=job["tp"])
    cfg = job["cfg"]
    torch.manual_seed(cfg.get("seed", 1234))
    model = build(cfg, job["tp"])
    if job["mode"] == "save":
        dist_checkpointing.save(model.sharded_state_dict(), job["ckpt_dir"])
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), job["ckpt_dir"]))
    out = logits(model, cfg["vocab_size"])
    if rank == 0:
        torch.save(out, job["out"])
    dist.barrier()


def rank_main(rank: int, jobs, port: int, world: int):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for job in jobs:
        run_job(job, rank)
    dist.destroy_process_group()


def main(argv):
    jobs = json.loads(argv[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for job in jobs:
        os.makedirs(job["ckpt_dir"], exist_ok=True)
    world = max(job["tp"] for job in jobs)
    # Forked, not spawned: the ranks inherit Megatron's imports (~8 s each on a 2-core host); this process has
    # run no torch op yet, so there is no thread pool to inherit.
    torch.multiprocessing.start_processes(rank_main, args=(jobs, port, world), nprocs=world, start_method="fork")


if __name__ == "__main__":
    main(sys.argv[1:])

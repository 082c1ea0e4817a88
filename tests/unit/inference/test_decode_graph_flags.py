"""Megatron's inference scripts ask for CUDA graphs with --cuda-graph-impl local (or --enable-cuda-graph,
--cuda-graph-scope full_iteration_inference): the generation tools read them as the engine's decode graph, and
the training step's refusal of per-layer graphs does not reach them."""
import os
import subprocess
import sys

import pytest

from megatron.inference.engine_setup import add_generation_args, resolve_decode_graph_flags
from megatron.training.arguments import parse_args
from megatron.training.arguments.errors import ArgumentError, require
from megatron.training.arguments.fast_path import validate_cuda_graph_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODEL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64".split()


def _args(flags):
    return parse_args(add_generation_args, argv=MODEL + flags.split())


@pytest.mark.parametrize("flags", ["--cuda-graph-impl local", "--enable-cuda-graph",
                                   "--cuda-graph-impl local --cuda-graph-scope full_iteration_inference",
                                   "--cuda-graph-scope attn moe_router moe_preprocess",
                                   "--cuda-graph-impl local --cuda-graph-modules attn mlp",
                                   "--cuda-graph-impl transformer_engine", "--external-cuda-graph"])
def test_megatron_graph_flags_select_the_decode_graph(flags):
    args = _args(flags)
    with pytest.raises(ArgumentError):  # what training says to the same flags
        validate_cuda_graph_args(_args(flags), require)
    resolve_decode_graph_flags(args)
    assert args.inference_cuda_graph_scope == "block"  # build_engine: graphs on
    assert args.cuda_graph_impl == "none" and not args.cuda_graph_scope and args.cuda_graph_modules == []
    assert not args.enable_cuda_graph and not args.external_cuda_graph
    validate_cuda_graph_args(args, require)  # nothing left for the training checks to refuse


def test_an_explicit_inference_scope_is_kept():
    args = _args("--cuda-graph-impl local --inference-cuda-graph-scope layer")
    resolve_decode_graph_flags(args)
    assert args.inference_cuda_graph_scope == "layer"


def test_without_graph_flags_the_engine_default_stays():
    args = _args("")
    resolve_decode_graph_flags(args)
    assert args.inference_cuda_graph_scope is None  # the engine's default: graphs on CUDA


@pytest.mark.parametrize("flags,named", [
    ("--cuda-graph-impl local --inference-cuda-graph-scope none", "--cuda-graph-impl local"),
    ("--enable-cuda-graph --inference-cuda-graph-scope none", "--enable-cuda-graph"),
    ("--cuda-graph-scope bogus", "--cuda-graph-scope / --cuda-graph-modules bogus"),
])
def test_contradictions_and_unknown_scopes_get_one_line(flags, named, capsys):
    with pytest.raises(SystemExit) as e:
        resolve_decode_graph_flags(_args(flags))
    assert str(e.value).startswith(f"error: {named}") and "\n" not in str(e.value)


def test_generate_runs_with_megatrons_inference_flags():
    """tools/generate.py as Megatron's inference scripts call it (random weights, CPU: the engine runs the bucketed
    decode steps its graphs would replay): the graph flags, the dynamic engine's request cap and prefill budget,
    the step log."""
    cmd = [sys.executable, os.path.join(ROOT, "tools", "generate.py"), *MODEL, "--tokenizer-type", "NullTokenizer",
           "--vocab-size", "128", "--prompt", "1 2 3", "--num-tokens-to-generate", "4", "--cuda-graph-impl", "local",
           "--cuda-graph-scope", "full_iteration_inference", "--inference-dynamic-batching-max-requests", "2",
           "--inference-dynamic-batching-max-tokens", "64", "--inference-logging-step-interval", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "CUDA graphs on" in p.stdout and "--- 4 tokens" in p.stdout
    assert "generation engine: 2 slots" in p.stdout and "inference step 1 | active requests 1" in p.stdout


def test_buffer_size_gives_the_slots_that_fit():
    """--inference-dynamic-batching-buffer-size-gb: the slots of max_len tokens whose keys and values fit, capped by
    --inference-dynamic-batching-max-requests; a buffer that holds no request is refused with the size one needs."""
    from megatron.inference.engine_setup import kv_cache_slots
    from tests.fixtures.tiny_gpt import single_rank, tiny_config, tiny_gpt
    single_rank()
    model = tiny_gpt(tiny_config(num_attention_heads=4, num_query_groups=2))  # 2 layers, 2 groups of 8, fp32
    per_slot = 2 * (2 * 2 * 8 * 4) * 64  # layers x (key + value) x groups x head dim x bytes, 64 tokens
    assert kv_cache_slots(model, 10.5 * per_slot / 2 ** 30, 64) == 10
    assert kv_cache_slots(model, 10.5 * per_slot / 2 ** 30, 64, max_requests=4) == 4
    with pytest.raises(ValueError, match="holds no request of 64 tokens"):
        kv_cache_slots(model, 0.5 * per_slot / 2 ** 30, 64)

"""Every flag of Megatron-LM 0.19.2's parser, recognized with Megatron's dest, type, default and choices.

`add_megatron_flags(parser)` runs after all our argument adders (and the entry point's extra ones). A flag
our parser already defines *works*. Every other option string of `megatron_flags_0.19.2.tsv` is added here:
- an option whose dest one of our flags already owns (`--no-barrier-with-level-1-timing`,
  `--disable-log-loss-scale-to-tensorboard`) sets that dest: it *works* as an alias;
- a flag of `NO_EFFECT` selects a Megatron kernel or implementation detail with no counterpart here: the
  run is the same with or without it; it is accepted and listed once in the start-up log;
- any other flag is *not supported yet*: accepted at its default, refused by `validate_args` with
  `--flag is not supported yet: <reason>` at any other value.
Statuses are computed each time a parser is built, so a flag another module starts defining (and deletes
from `UNSUPPORTED_FLAGS`) becomes "works" with no edit here.

`python -m megatron.training.arguments.megatron_flags_docs --write-docs` regenerates the table in
docs/migrating.md.
"""
import argparse
import ast
import os
import re
from dataclasses import dataclass
from typing import Optional, Tuple

from .errors import ArgumentError
from .unsupported import UNSUPPORTED_FLAGS

TSV_PATH = os.path.join(os.path.dirname(__file__), "megatron_flags_0.19.2.tsv")
WORKS, NO_EFFECT_HERE, NOT_SUPPORTED = "works", "no effect here", "not supported yet"
_SEEN = "_megatron_flags_seen"  # namespace attribute: {dest: (option, status, default, reason)}

# Megatron kernel/implementation switches with no counterpart here: the run is the same with or without.
NO_EFFECT = {
    "--use-mcore-models": "the models here are Megatron Core models; there is no legacy model",
    "--disable-jit-fuser": "no TorchScript fuser is used; fusions are Triton/torch.compile with eager fallbacks",
    "--te-rng-tracker": "Transformer Engine's CUDA-graph-safe RNG tracker maps to ours: dropout always draws "
                        "from our RNG tracker, which is CUDA-graph safe",
    "--use-te-activation-func": "no Transformer Engine: the activation is the same torch function",
    "--use-transformer-engine-op-fuser": "no Transformer Engine: layers are our torch modules",
    "--cross-entropy-fusion-impl": "picks Megatron's native or Transformer Engine fused cross-entropy kernel; "
                                   "--cross-entropy-loss-fusion here has one implementation, same loss",
    "--enable-experimental": "Megatron's switch that lets its experimental APIs run; features here are each "
                             "turned on by their own flag",
    "--flash-attention-version": "attention runs through torch SDPA, which picks its kernel",
    "--fp8-interval": "deprecated and ignored in Megatron too (tensorwise scaling updates every step)",
    "--tp-comm-overlap-rs-dgrad": "Transformer Engine userbuffer knob; --tp-comm-overlap here always runs the "
                                  "dgrad reduce-scatter behind the wgrad GEMM",
    "--no-tp-comm-split-ag": "Transformer Engine userbuffer knob; --tp-comm-overlap here is always a split "
                             "(chunked ring) pipeline, no atomic GEMM",
    "--no-tp-comm-split-rs": "Transformer Engine userbuffer knob; --tp-comm-overlap here is always a split "
                             "(chunked ring) pipeline, no atomic GEMM",
    "--tp-comm-bootstrap-backend": "Transformer Engine userbuffer bootstrap; --tp-comm-overlap here uses the "
                                   "TP process group, no userbuffers",
    "--use-ring-exchange-p2p": "pipeline send/recv are torch.distributed P2P ops; results are the same",
    "--moe-router-padding-for-quantization": "pads each expert's token count to a multiple of 16/32 for quantized "
                                             "(FP8/FP4) grouped GEMMs; the experts here run unquantized grouped "
                                             "GEMMs that need no padding, so the run is the same",
    "--moe-router-padding-for-fp8": "Megatron's older name of --moe-router-padding-for-quantization: the experts "
                                    "here run unquantized grouped GEMMs that need no padding",
    "--fsdp-double-buffer": "Megatron-FSDP's two alternating parameter-gather buffers (with --use-nccl-ub); "
                            "--use-megatron-fsdp runs here on DDP, the distributed optimizer or torch FSDP2, which "
                            "manage their own buffers, with the same results",
    "--fsdp-manual-registration": "registers Megatron-FSDP's buffers with NCCL by hand (with --use-nccl-ub); the "
                                  "FSDP layouts here use NCCL's default registration, with the same results",
    "--use-nccl-ub": "registers the DP/FSDP communication buffers with NCCL's user buffers (fewer SMs for the "
                     "collectives); the collectives here use NCCL's default path on the same buffers, with the same "
                     "results",
    "--inference-fuse-tp-communication": "selects a fused reduce-scatter + residual + norm + all-gather kernel of "
                                         "Megatron's inference-optimized layers; generation here runs the same "
                                         "layers' all-reduce, with the same results",
    "--no-clone-scatter-output-in-embedding": "a memory workaround of Megatron's embedding; ours has no clone",
    "--ckpt-fully-parallel-save": "deprecated in Megatron-LM too: the fully parallel save is on by default; "
                                  "--no-ckpt-fully-parallel-save turns it off",
    "--dist-ckpt-optim-fully-reshardable": "optimizer state is always saved fully reshardable here (one tensor per "
                                           "param and state, any TP/PP/DP layout loads it); Megatron-LM's "
                                           "fully_reshardable checkpoints load, and so do its default "
                                           "dp_reshardable ones (at their TP/PP, any DP)",
    "--distrib-optim-fully-reshardable-mem-efficient": "only tunes how Megatron gathers the state for "
                                                       "--dist-ckpt-optim-fully-reshardable; same checkpoint",
    "--ckpt-fully-parallel-load-exchange-algo": "the fully parallel load broadcasts each chunk from the rank that "
                                                "read it; Megatron's other exchange algorithms give the same values",
    "--ckpt-assume-constant-structure": "a save-plan cache; checkpoint contents are the same",
    "--no-ckpt-load-validate-sharding-integrity": "skips a load-time check that torch_dist loads do not run",
    "--use-persistent-ckpt-worker": "--async-save writes from a background thread; same files either way",
    "--async-strategy": "--async-save has one implementation (a background thread); same files",
    "--use-legacy-static-engine": "generation has one engine here (continuous batching over KV-cache slots, "
                                  "docs/inference.md); same generated tokens",
    "--flash-decode": "decode attention is torch's SDPA over the KV cache, captured in the decode step's CUDA "
                      "graph: there is no separate flash-decoding kernel to select; same tokens",
    "--inference-rng-tracker": "sampling draws each request's uniform numbers on the host from the request's own "
                               "generator and hands them to the (CUDA-graph) step: no device RNG tracker is "
                               "involved; same tokens",
    "--decode-only-cuda-graphs": "the engine's CUDA graphs cover its decode steps only; prefill always runs "
                                 "eagerly",
    "--max-tokens-to-oom": "the guard of Megatron's legacy generation API, which Megatron 0.19 reads nowhere either; "
                           "the engine here sizes its KV cache from --inference-max-requests and "
                           "--inference-max-seq-length and refuses longer requests itself",
    "--async-ckpt-use-cpu-shm": "--async-save stages tensors in pinned host buffers that its background thread, in "
                                "the same process, writes from: there is no writer process to share memory with; "
                                "same files",
    "--no-use-tokenizer-model-from-checkpoint-args": "--use-checkpoint-args never takes --tokenizer-model "
                                                     "from the checkpoint here",
    "--no-align-grad-reduce": "only moves when bucket reductions are launched; gradients are the same",
    "--no-align-param-gather": "only moves when param all-gathers are launched; params are the same",
    "--ddp-pad-buckets-for-high-nccl-busbw": "bucket padding for NCCL bandwidth; gradients are the same",
    "--no-pin-cpu-grads": "only read with --optimizer-cpu-offload, which is not supported",
    "--no-pin-cpu-params": "only read with --optimizer-cpu-offload, which is not supported",
    "--no-one-logger": "there is no One Logger telemetry here",
    "--disable-msc": "there is no Multi-Storage Client here; paths are local files",
    "--trust-remote-code": "HuggingFaceTokenizer reads tokenizer.json only and never runs a model's own code",
}

# Megatron's reasons for a few deprecated flags, flags that only another entry point reads, and why a few flags
# of features built here stay refused.
REASONS = {
    "--fp8-param-gather": "FP8 parameters (Transformer Engine Float8Tensor weights all-gathered in FP8) have no "
                          "counterpart: --fp8 here keeps bf16 parameters and casts each GEMM's inputs; drop the "
                          "flag",
    "--batch-size": "use --micro-batch-size (as Megatron says)",
    "--warmup": "use --lr-warmup-fraction or --lr-warmup-iters (as Megatron says)",
    "--checkpoint-activations": "use --recompute-activations or --recompute-granularity full",
    "--model-parallel-size": "use --tensor-model-parallel-size",
    "--ckpt-convert-format": "convert checkpoints with tools/checkpoint/convert.py",
    "--inference-dynamic-batching-prefix-caching-coordinator-policy":
        "routes requests among data-parallel inference engines through Megatron's coordinator; there is no "
        "multi-engine coordinator here (one engine serves, replicated across TP ranks)",
    "--inference-dynamic-batching-prefix-caching-routing-alpha":
        "weighs prefix hits against load in Megatron's data-parallel coordinator; there is no multi-engine "
        "coordinator here",
    "--inference-dynamic-batching-prefix-caching-mamba-gb":
        "Mamba state snapshots for prefix caching are not built; --inference-dynamic-batching-prefix-caching is "
        "refused for models with Mamba-2 / Gated DeltaNet layers",
}
OTHER_ENTRY_POINTS = {
    "--mask-prob": "pretrain_bert.py and pretrain_t5.py", "--short-seq-prob": "pretrain_bert.py and pretrain_t5.py",
    "--bert-no-binary-head": "pretrain_bert.py", "--encoder-num-layers": "pretrain_t5.py and pretrain_vlm.py",
    "--img-h": "pretrain_vlm.py and pretrain_vision_classify.py",
    "--img-w": "pretrain_vlm.py and pretrain_vision_classify.py",
    "--patch-dim": "pretrain_vlm.py and pretrain_vision_classify.py",
    "--num-channels": "pretrain_vlm.py and pretrain_vision_classify.py",
    "--num-classes": "pretrain_vision_classify.py", "--classes-fraction": "pretrain_vision_classify.py",
    "--data-per-class-fraction": "pretrain_vision_classify.py",
    "--vision-backbone-type": "pretrain_vision_classify.py", "--vision-pretraining-type": "pretrain_vision_classify.py",
    "--decoder-num-layers": "pretrain_t5.py", "--decoder-seq-length": "pretrain_t5.py",
}
# Why the flags of a Megatron parser group that our parser does not define are refused. Groups whose flags
# all work here (straggler, rerun engine) need no entry.
_GROUP_REASONS = {
    "moe": "MoE upcycling (a dense checkpoint turned into experts) is not built; MoE itself works (docs/moe.md)",
    "mla": "this multi-latent attention option is not built; MLA itself works (docs/deepseek.md)",
    "rl": "RL training is not part of this project",
    "vision": "this option of Megatron's legacy vision entry points (inpainting, DINO, MiT/Swin backbones) is not "
              "built; ViT classification trains with pretrain_vision_classify.py and vision-language models "
              "with pretrain_vlm.py (docs/multimodal.md)",
    "biencoder": "retrieval models are not part of this project",
    "inference": "this option of Megatron's inference engines is not built; generation runs on "
                 "megatron/core/inference's engine (tools/generate.py, docs/inference.md)",
    "In-process restart": "in-process restart is not supported", "ft_package": "fault tolerance is not supported",
    "one logger": "there is no One Logger telemetry here",
    "Logits Distillation": "logit distillation is not supported", "Transformer-Engine": "needs Transformer Engine",
    "fault injector": "fault injection is not supported", "msc": "there is no Multi-Storage Client here",
    "experimental_attention_variant": "experimental attention variants are not built",
    "heterogeneous architecture": "heterogeneous layers are not supported",
}


@dataclass(frozen=True)
class FlagSpec:
    """One row of the tsv: Megatron's argparse action for one or more option strings."""
    options: Tuple[str, ...]
    dest: str
    action: str
    type: str
    default: object
    choices: Optional[tuple]
    nargs: Optional[str]
    group: str


def _literal(text):
    enum = re.fullmatch(r"<\w+\.(\w+): [^>]*>", text)  # <Signals.SIGTERM: 15> -> 'SIGTERM'
    if enum:
        return enum.group(1)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _freq(text):
    """Megatron's moe/la/no-rope frequency types: an int, or a Python list expression kept as text."""
    return int(text) if text.lstrip("-").isdigit() else text


def _int_tuple(text):
    return tuple(int(v) for v in text.strip("()[] ").split(","))


def _bool(text):
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


_TYPES = {"int": int, "float": float, "str": str, "bool": _bool, "": None, "moe_freq_type": _freq,
          "la_freq_type": _freq, "no_rope_freq_type": _freq, "tuple_type": _int_tuple,
          "_parse_cuda_graph_modules_arg": str, "enum_type_handler": str}


def load_specs(path=TSV_PATH):
    """The tsv rows as FlagSpecs, in Megatron's parser order."""
    specs = []
    with open(path) as f:
        lines = [line.rstrip("\n") for line in f if not line.startswith("#")]
    for line in lines[1:]:
        options, dest, action, type_, default, choices, nargs, group = line.split("\t")
        convert = _TYPES[type_] or str
        choice_list = tuple(convert(c) for c in choices.split("|")) if choices and type_ != "enum_type_handler" \
            else None
        specs.append(FlagSpec(tuple(options.split()), dest, action, type_, _literal(default), choice_list,
                              nargs or None, group))
    return specs


def _recording(action_cls):
    """An argparse action that also notes, on the namespace, which registered flag the user set."""
    class Recording(action_cls):
        def __call__(self, parser, namespace, values, option_string=None):
            super().__call__(parser, namespace, values, option_string)
            record_use(namespace, self, option_string)
    Recording.__name__ = action_cls.__name__
    return Recording


def record_use(namespace, action, option_string):
    """Remember that ``option_string`` (or a YAML key) set a registered flag; validate_args checks it."""
    seen = namespace.__dict__.setdefault(_SEEN, {})
    seen[action.dest] = (option_string or action.option_strings[0], action.megatron_status,
                         action.megatron_default, action.megatron_reason)


_ACTIONS = {"Store": argparse._StoreAction, "StoreTrue": argparse._StoreTrueAction,
            "StoreFalse": argparse._StoreFalseAction, "BooleanOptional": argparse.BooleanOptionalAction}


def _reason(spec):
    flag = spec.options[0]
    if flag in UNSUPPORTED_FLAGS:
        return UNSUPPORTED_FLAGS[flag][1]
    if flag in REASONS:
        return REASONS[flag]
    if flag in OTHER_ENTRY_POINTS:
        return f"only {OTHER_ENTRY_POINTS[flag]} read it"
    return _GROUP_REASONS.get(spec.group, f"not built here yet (Megatron's '{spec.group}' group)")


def _kwargs(spec):
    kw = dict(dest=spec.dest, default=spec.default)
    if spec.action == "Store":
        kw.update(type=_TYPES[spec.type], choices=spec.choices, nargs=spec.nargs)
        kw = {k: v for k, v in kw.items() if v is not None or k == "default"}
    return dict(kw, action=_recording(_ACTIONS[spec.action]))


def add_megatron_flags(parser):
    """Add every tsv flag the parser lacks; ``parser.megatron_flags`` maps each option string to
    (status, note). Call after all other adders."""
    defined = {o: a for a in parser._actions for o in a.option_strings}
    our_dests = {a.dest: a for a in parser._actions}
    added = {}  # dest -> the first action this registry added for it
    table, group = {}, parser.add_argument_group(title="other Megatron-LM flags (see docs/migrating.md)")
    for spec in load_specs():
        missing = [o for o in spec.options if o not in defined]
        table.update({o: (WORKS, "") for o in spec.options if o in defined})
        if not missing or spec.action == "Help":
            continue
        owner = next((defined[o] for o in spec.options if o in defined), None) or our_dests.get(spec.dest)
        if owner is not None:  # an alias of one of our flags: it sets the dest our code reads
            action = _alias_action(spec, missing, owner)
            group.add_argument(*missing, dest=owner.dest, default=argparse.SUPPRESS, help=f"Alias of "
                               f"{owner.option_strings[0]}.", **action)
            table.update({o: (WORKS, f"alias of `{owner.option_strings[0]}`") for o in missing})
            continue
        status = NO_EFFECT_HERE if spec.options[0] in NO_EFFECT else NOT_SUPPORTED
        reason = NO_EFFECT.get(spec.options[0]) or _reason(spec)
        kw = _kwargs(spec)
        first = added.get(spec.dest)
        if first is not None:  # a second flag for one dest (a --X / --no-X pair): the first sets the default
            kw["default"] = argparse.SUPPRESS
        # BooleanOptionalAction makes the --no- form itself.
        options = [o for o in missing if spec.action != "BooleanOptional" or not o.startswith("--no-")]
        action = group.add_argument(*options, help=f"{status}: {reason}".replace("%", "%%"), **kw)
        action.megatron_status, action.megatron_reason = status, reason
        action.megatron_default = spec.default if first is None else first.megatron_default
        added.setdefault(spec.dest, action)
        table.update({o: (status, reason) for o in missing})
    parser.megatron_flags = table
    return parser


def _alias_action(spec, missing, owner):
    """argparse kwargs for extra option strings of a dest we own: the no-form stores False."""
    if spec.action == "StoreFalse" or (spec.action == "BooleanOptional" and missing[0].startswith("--no-")):
        return dict(action="store_false")
    if spec.action in ("StoreTrue", "BooleanOptional"):
        return dict(action="store_true")
    return dict(type=owner.type, nargs=owner.nargs, choices=owner.choices)


def is_default(value, default):
    """Megatron's defaults of nargs flags may be scalars ('aux_loss' for a list of one) or tuples."""
    if isinstance(value, (list, tuple)):
        return list(value) == (list(default) if isinstance(default, (list, tuple)) else [default])
    return value == default


def check_megatron_flags(args):
    """Refuse a not-supported flag set to a non-default value; list no-effect flags once (rank 0)."""
    seen = args.__dict__.pop(_SEEN, {})
    for dest, (option, status, default, reason) in seen.items():
        if is_default(getattr(args, dest, default), default):
            continue
        if status == NOT_SUPPORTED:
            raise ArgumentError(f"{option} is not supported yet: {reason}")
        if status == NO_EFFECT_HERE and args.rank == 0:
            print(f"{option} has no effect here (same result): {reason}", flush=True)

"""Flags for the training loop, learning-rate schedule, checkpointing, evaluation and logging."""
import argparse

from .optimizer_args import OPTIMIZERS


class _JoinWords(argparse.Action):
    """One string from the flag's words: Megatron's GPT-3 175B script expands its schedule unquoted, so the entries
    arrive as separate arguments (which Megatron's own parser refuses)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, " ".join(values))


def add_training_args(parser):
    g = parser.add_argument_group(title="training")
    g.add_argument("--micro-batch-size", type=int, default=None, help="Samples per micro-batch per rank.")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per optimizer step; default micro-batch-size x data-parallel size.")
    g.add_argument("--rampup-batch-size", nargs="*", default=None,
                   help="<start batch size> <increment> <ramp-up samples>: linear global-batch rampup.")
    g.add_argument("--step-batch-size-schedule", nargs="+", action=_JoinWords, default=None,
                   help="Global batch size by training progress, \"THRESHOLD:BS THRESHOLD:BS ...\" (first threshold "
                        "0): the batch size BS from THRESHOLD tokens trained on (samples x --seq-length); K, M, B, T "
                        "scale a number by 1e3, 1e6, 1e9, 1e12, e.g. \"0:768 250B:1536 500B:3072\". Replaces "
                        "--global-batch-size and --rampup-batch-size. Its entries may also come as separate words "
                        "(a script that expands the schedule unquoted).")
    g.add_argument("--decrease-batch-size-if-needed", action="store_true",
                   help="Round the global batch down to a multiple of micro-batch x DP.")
    g.add_argument("--eval-micro-batch-size", type=int, default=None,
                   help="Samples per micro-batch per rank in evaluation (default --micro-batch-size).")
    g.add_argument("--eval-global-batch-size", type=int, default=None,
                   help="Samples per evaluation step (default --global-batch-size); --eval-iters counts these.")
    g.add_argument("--train-iters", type=int, default=None, help="Iterations to train.")
    g.add_argument("--train-samples", type=int, default=None, help="Samples to train (sample-based run).")
    g.add_argument("--exit-interval", type=int, default=None, help="Exit when iteration %% N == 0.")
    g.add_argument("--iterations-to-skip", nargs="+", type=int, default=[],
                   help="Iterations (1-based, as the log counts them) whose global batch is read and dropped "
                        "without a step: no forward, backward or optimizer update (e.g. batches that made the loss "
                        "spike); the log counts them as skipped samples.")
    g.add_argument("--train-sync-interval", type=int, default=None,
                   help="Every N iterations wait for the GPU to finish the queued work, so the host does not run "
                        "too far ahead of it.")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                   help="Every N iterations (and at the start), check that every data-parallel replica holds the "
                        "same weights (a SHA-1 per parameter); stop with the differing parameters otherwise.")
    g.add_argument("--exit-duration-in-mins", type=int, default=None, help="Exit after N minutes of training.")
    g.add_argument("--manual-gc", action="store_true",
                   help="Turn Python's automatic garbage collector off during training; collect every "
                        "--manual-gc-interval iterations instead (the same iteration on every rank).")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="With --manual-gc: collect every N iterations (0: never during training).")
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="With --manual-gc: do not collect around evaluations.")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On --exit-signal, finish the step, save (with --save) and exit 0.")
    g.add_argument("--exit-signal", type=str, default="SIGTERM", help="Signal name for --exit-signal-handler.")
    g.add_argument("--optimizer", type=str, default="adam", choices=OPTIMIZERS,
                   help="adam (AdamW), sgd, lion, muon (Muon on 2-D hidden weights, AdamW on the rest) or "
                        "dist_muon (muon with --use-distributed-optimizer); soap and adaptive_muon are not built.")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard optimizer state across data-parallel ranks.")
    g.add_argument("--overlap-grad-reduce", action="store_true", help="Overlap DP grad reduce with backward.")
    g.add_argument("--overlap-param-gather", action="store_true", help="Overlap param all-gather with forward.")
    g.add_argument("--ddp-bucket-size", type=int, default=None, help="DDP bucket size in parameters.")
    g.add_argument("--ddp-num-buckets", type=int, default=None,
                   help="Instead of --ddp-bucket-size: about this many gradient buckets, sized as the rank's "
                        "parameters (all its model chunks) divided by it.")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="With --use-distributed-optimizer: N replicas of the optimizer state, each sharded over 1/N "
                        "of the data-parallel (x context-parallel) group; gradients are reduce-scattered within a "
                        "part and the shards all-reduced across the N parts.")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="Average gradients inside the collective instead of pre-scaling.")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="Normalise gradients by the global non-padded token count.")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad", help="Skip NaN/Inf checks on loss and gradients.")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="Release cached device memory: 1 after each step, 2 also after evaluation.")
    g.add_argument("--skip-train", action="store_true", help="Only evaluate (no training).")
    g.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion",
                   help="Disable fused masked softmax.")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
                   help="Disable fused bias+GeLU.")
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion",
                   help="Disable fused bias+SwiGLU.")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion",
                   help="Disable fused bias+dropout.")
    g.add_argument("--no-persist-layer-norm", action="store_true", help="Disable the persistent layernorm kernel.")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                   dest="gradient_accumulation_fusion", help="Disable fused weight-gradient accumulation.")
    return parser


def add_learning_rate_args(parser):
    g = parser.add_argument_group(title="learning rate")
    g.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    g.add_argument("--min-lr", type=float, default=0.0, help="Floor learning rate.")
    g.add_argument("--lr-decay-style", type=str, default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"], help="LR decay.")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Decay horizon in iterations.")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="Decay horizon in samples.")
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="Warmup as a fraction of decay.")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Warmup iterations.")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="Warmup samples.")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="LR at the start of warmup.")
    g.add_argument("--lr-wsd-decay-style", type=str, default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"], help="WSD anneal shape.")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD anneal iterations.")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None, help="WSD anneal samples.")
    # Megatron-LM spells these two with an underscore (--override-opt_param-scheduler); both forms parse.
    g.add_argument("--override-opt-param-scheduler", "--override-opt_param-scheduler", action="store_true",
                   help="Use the command-line scheduler values, not the checkpoint's.")
    g.add_argument("--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler",
                   action="store_true",
                   help="Use the checkpoint's scheduler values.")
    g.add_argument("--decoupled-lr", type=float, default=None, help="Separate LR for embedding/output.")
    g.add_argument("--decoupled-min-lr", type=float, default=None, help="Separate min LR for embedding/output.")
    return parser


def add_checkpointing_args(parser):
    g = parser.add_argument_group(title="checkpointing")
    g.add_argument("--save", type=str, default=None, help="Checkpoint save directory.")
    g.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None,
                   help="Iterations between checkpoint saves.")
    g.add_argument("--no-save-optim", action="store_true", default=None, help="Do not save optimizer state.")
    g.add_argument("--no-save-rng", action="store_true", default=None, help="Do not save RNG state.")
    g.add_argument("--load", type=str, default=None, help="Checkpoint directory to resume from.")
    g.add_argument("--no-load-optim", action="store_true", default=None, help="Do not load optimizer state.")
    g.add_argument("--no-load-rng", action="store_true", default=None, help="Do not load RNG state.")
    g.add_argument("--finetune", action="store_true", help="Load weights only and reset the iteration to 0.")
    g.add_argument("--pretrained-checkpoint", type=str, default=None, help="Fallback load dir for --finetune.")
    g.add_argument("--ckpt-step", type=int, default=None, help="Iteration to load instead of the latest.")
    g.add_argument("--ckpt-format", default="torch_dist", choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"],
                   help="Checkpoint format: torch_dist (sharded, reshards across layouts) or torch (one file per "
                        "model-parallel rank); Megatron's torch_dcp and fsdp_dtensor are not built.")
    g.add_argument("--ckpt-save-megatron-layout", action="store_true",
                   help="Save torch_dist checkpoints in Megatron-LM's own layout (stacked layers, its distributed "
                        "optimizer's fully_reshardable state), so Megatron-LM resumes from them; loads here too.")
    g.add_argument("--auto-detect-ckpt-format", action="store_true", help="Detect the format when loading.")
    g.add_argument("--async-save", action="store_true",
                   help="Write torch_dist checkpoints in the background; training continues.")
    g.add_argument("--no-async-save-pinned-buffers", dest="async_save_pinned_buffers", action="store_false",
                   help="(Not a Megatron-LM flag.) --async-save copies the state into host buffers allocated at "
                        "the first save and kept for the next ones, page-locked on CUDA so that the copy runs "
                        "in the background (host RAM equal to this rank's share of the checkpoint, held for the "
                        "whole run). With this flag each save copies into fresh pageable host memory, freed "
                        "after the write, and training waits for the whole copy.")
    g.add_argument("--no-ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save", action="store_false",
                   help="torch_dist: DP rank 0 writes every DP-replicated tensor (the weights) instead of spreading "
                        "those writes evenly over the DP ranks. Each DP rank writes its own range of the "
                        "distributed optimizer's state either way.")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="torch_dist: each weight replicated over DP is read from storage by one DP rank (reads "
                        "spread evenly) and broadcast to the others, instead of every DP rank reading it.")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="Fail if --load has no checkpoint instead of starting from scratch.")
    g.add_argument("--ckpt-fallback-to-previous", action="store_true",
                   help="(Not a Megatron-LM flag.) When the latest checkpoint under --load cannot be read (a "
                        "truncated or corrupt file), load the newest older complete one instead of failing.")
    g.add_argument("--verify-integrity", action="store_true",
                   help="torch_dist: write SHA-256 hashes of every checkpoint file (integrity.json) on save and "
                        "check them on load, so a corrupt file is found and named before it is read.")
    g.add_argument("--save-retain-interval", type=int, default=None,
                   help="Keep only saves whose iteration is a multiple of N (plus the latest).")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="Take the model architecture flags from the checkpoint under --load.")
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="Iterations between non-persistent saves: only the newest is kept (written to "
                        "--non-persistent-global-ckpt-dir, default <--save>/non_persistent), and a restart resumes "
                        "from it when it is newer than the last --save-interval checkpoint.")
    g.add_argument("--non-persistent-ckpt-type", type=str, default=None, choices=["global", "local", "in_memory"],
                   help="global: a regular checkpoint on the shared file system (the one built here; local and "
                        "in_memory need nvidia-resiliency-ext's checkpoint managers).")
    g.add_argument("--non-persistent-global-ckpt-dir", type=str, default=None,
                   help="Directory of the global non-persistent checkpoints (default <--save>/non_persistent).")
    g.add_argument("--non-persistent-local-ckpt-dir", type=str, default=None,
                   help="Node-local directory of local non-persistent checkpoints (not built here).")
    g.add_argument("--non-persistent-local-ckpt-algo", type=str, default="fully_parallel",
                   choices=["fully_parallel", "atomic"], help="Local non-persistent checkpoints' algorithm (not "
                                                              "built here).")
    return parser


def add_validation_args(parser):
    g = parser.add_argument_group(title="validation")
    g.add_argument("--eval-iters", type=int, default=100, help="Global batches per evaluation.")
    g.add_argument("--eval-interval", type=int, default=None, help="Iterations between evaluations.")
    g.add_argument("--start-eval-at-iter", type=int, default=None,
                   help="No evaluation before this iteration (the --eval-interval ones before it are skipped, and "
                        "the validation split is sized without them).")
    return parser


def add_logging_args(parser):
    g = parser.add_argument_group(title="logging")
    g.add_argument("--log-interval", type=int, default=100, help="Iterations between log lines.")
    g.add_argument("--log-params-norm", action="store_true", help="Log the parameter L2 norm.")
    g.add_argument("--log-num-zeros-in-grad", action="store_true", help="Log zero gradient entries.")
    g.add_argument("--log-throughput", action="store_true", help="Log TFLOP/s per GPU.")
    g.add_argument("--log-memory-interval", type=int, default=None,
                   help="Print the device memory report (allocated, max allocated, reserved, max reserved MB) every "
                        "N iterations, not only after the first; a multiple of --log-interval.")
    g.add_argument("--log-device-memory-used", action="store_true",
                   help="Add the whole device's used memory (every process on the GPU, from the driver) to the "
                        "memory report.")
    g.add_argument("--log-progress", action="store_true",
                   help="Append job starts and each checkpoint's throughput, floating-point operations and tokens "
                        "to progress.txt in the --save directory (it accumulates across restarts).")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2], help="Timer detail level.")
    g.add_argument("--timing-log-option", type=str, default="minmax", choices=["max", "minmax", "all"],
                   help="How timers are reduced across ranks.")
    g.add_argument("--barrier-with-L1-time", action="store_true", default=True,
                   help="Barrier before level-1 timers (kept for compatibility; on by default).")
    g.add_argument("--tensorboard-dir", type=str, default=None, help="TensorBoard log directory.")
    g.add_argument("--tensorboard-log-interval", type=int, default=1, help="Iterations between TB writes.")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000, help="TB writer queue size.")
    g.add_argument("--log-timers-to-tensorboard", action="store_true", help="Write timers to TB.")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false",
                   dest="log_loss_scale_to_tensorboard", help="Do not write the loss scale to TB.")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true", help="Write validation PPL to TB.")
    g.add_argument("--log-memory-to-tensorboard", action="store_true", help="Write memory use to TB.")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true", help="Write world size to TB.")
    g.add_argument("--wandb-project", type=str, default="", help="W&B project (enables W&B).")
    g.add_argument("--wandb-exp-name", type=str, default="", help="W&B run name.")
    g.add_argument("--wandb-save-dir", type=str, default="", help="W&B local directory.")
    g.add_argument("--wandb-entity", type=str, default="", help="W&B entity.")
    g.add_argument("--logging-level", type=int, default=None,
                   help="Python logging level (records at or above it print to stderr).")
    return parser

"""--cuda-graph-impl full_iteration: flag handling, and the wrapper's data flow reproducing eager training.

A CUDA graph cannot be captured on CPU, so these tests give the wrapper a graph whose replay re-runs
the captured function: the step then reads its micro-batches only from the static buffers the wrapper
refills each step, which is the property the real graph depends on. tests/gpu/test_full_cuda_graph_gpu.py
runs the same comparison with a real CUDA graph.
"""
import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBatches
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.training.arguments import parse_args, validate_args
from megatron.training.arguments.validation import ArgumentError
from tests.fixtures.tiny_gpt import single_rank, tiny_config, tiny_gpt, train_step

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 2 --train-iters 3 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 63 --attention-dropout 0.0").split()


def _args(extra):
    return validate_args(parse_args(argv=BASE + extra.split()))


# ---- flags ---------------------------------------------------------------------------------------

def test_full_iteration_spellings():
    assert _args("--cuda-graph-impl full_iteration").cuda_graph_impl == "full_iteration"
    assert _args("--cuda-graph-impl local --cuda-graph-scope full_iteration").cuda_graph_impl == "full_iteration"
    assert _args("").cuda_graph_impl == "none"


@pytest.mark.parametrize("extra, match", [
    ("--cuda-graph-impl local", "per-layer CUDA graphs are not built"),
    ("--enable-cuda-graph", "per-layer CUDA graphs are not built"),
    ("--external-cuda-graph", "needs Transformer Engine"),
    ("--cuda-graph-impl full_iteration --cuda-graph-scope attn", "only full_iteration"),
    ("--cuda-graph-scope full_iteration", "needs --cuda-graph-impl full_iteration"),
    ("--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 0", "--cuda-graph-warmup-steps"),
    ("--cuda-graph-impl full_iteration --recompute-activations", "recompute"),
    ("--cuda-graph-impl full_iteration --rampup-batch-size 2 2 8 --global-batch-size 4", "rampup"),
    ("--cuda-graph-impl full_iteration --calculate-per-token-loss", "per-token"),
    ("--cuda-graph-impl full_iteration --fp16", "--loss-scale"),
    ("--cuda-graph-impl full_iteration --use-distributed-optimizer --overlap-param-gather "
     "--overlap-grad-reduce", "--overlap-param-gather"),
])
def test_refused_combinations_name_the_flag(extra, match):
    with pytest.raises(ArgumentError, match=match):
        _args(extra)


def test_layouts(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _args("--cuda-graph-impl full_iteration").data_parallel_size == 2  # DP is captured
    tp = "--cuda-graph-impl full_iteration --tensor-model-parallel-size 2"
    assert _args(tp).tensor_model_parallel_size == 2  # TP is captured (tests/parallel/: bitwise on CPU)
    assert _args(tp + " --sequence-parallel").sequence_parallel
    for extra, match in (("--tp-comm-overlap --sequence-parallel", "--tp-comm-overlap"),
                         ("--reset-attention-mask", "packed documents"),
                         ("--num-experts 4 --disable-bias-linear", "fixed all-to-all split sizes")):
        with pytest.raises(ArgumentError, match=match):
            _args(f"{tp} {extra}")
    moe = "--cuda-graph-impl full_iteration --num-experts 4 --disable-bias-linear --expert-model-parallel-size 2"
    with pytest.raises(ArgumentError, match="--moe-pad-expert-input-to-capacity"):
        _args(moe + " --moe-grouped-gemm --bf16")
    padded = _args(moe + " --moe-grouped-gemm --bf16 --moe-token-dispatcher-type alltoall "
                   "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity")
    assert padded.expert_model_parallel_size == 2
    local = "--cuda-graph-impl full_iteration --num-experts 4 --disable-bias-linear"
    # Every expert local: captured as one grouped GEMM in bf16; the per-expert loop and dropping without padding
    # count tokens on the host and are refused.
    assert _args(local + " --moe-grouped-gemm --bf16").num_experts == 4
    for extra, match in (("--bf16", "--moe-grouped-gemm and --bf16"), ("--moe-grouped-gemm", "--moe-grouped-gemm and"),
                         ("--moe-grouped-gemm --bf16 --moe-expert-capacity-factor 1.0", "pad-expert-input")):
        with pytest.raises(ArgumentError, match=match):
            _args(f"{local} {extra}")
    assert _args(local + " --moe-grouped-gemm --bf16 --moe-expert-capacity-factor 1.0 "
                 "--moe-pad-expert-input-to-capacity").moe_pad_expert_input_to_capacity
    assert _args("--cuda-graph-impl full_iteration --context-parallel-size 2").context_parallel_size == 2
    with pytest.raises(ArgumentError, match="packed documents"):
        _args("--cuda-graph-impl full_iteration --context-parallel-size 2 --reset-attention-mask")
    pp = "--cuda-graph-impl full_iteration --pipeline-model-parallel-size 2 --num-layers 4"
    assert _args(pp).pipeline_model_parallel_size == 2  # PP is captured, the interleaved schedule too
    assert _args(pp + " --num-layers-per-virtual-pipeline-stage 1").virtual_pipeline_model_parallel_size == 2


def test_attention_dropout_accepted():
    """Attention dropout forks to the model-parallel RNG state; graph-safe states make that capturable."""
    args = validate_args(parse_args(argv=BASE + "--cuda-graph-impl full_iteration --attention-dropout 0.1".split()))
    assert args.attention_dropout == 0.1


def test_graph_safe_rng_needs_cuda():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    tracker = CudaRNGStatesTracker()
    tracker.set_graph_safe(False)
    assert tracker.graph_safe_states() == []
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="need a CUDA device"):
            tracker.set_graph_safe(True)


# ---- the wrapper ---------------------------------------------------------------------------------

class ReexecutingGraph:
    """Capture runs the step once (a real capture records it and the first replay runs it); every
    later replay re-runs it and writes the results into the captured output tensors in place."""

    def warmup(self, fn):
        return fn()

    def capture(self, fn):
        self.fn, self.outputs, self.ran = fn, fn(), True
        return self.outputs

    def replay(self):
        if self.ran:
            self.ran = False
            return
        _copy_tensors(self.outputs, self.fn())


def _copy_tensors(dst, src):
    if torch.is_tensor(dst):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for k in dst:
            _copy_tensors(dst[k], src[k])
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            _copy_tensors(d, s)


def train_losses(steps, wrap=None, device="cpu", dtype=torch.float32, num_microbatches=2, attention_dropout=0.0,
                 graph_safe_rng=False, one_iterator=False):
    """Per-step losses of a 2-layer GPT trained through DDP, the Megatron optimizer and the no-pipelining
    schedule; ``wrap(fbf)`` optionally wraps the schedule (as the training loop does for graphs).
    ``one_iterator``: every step reads from one iterator over the whole run, as training does (else each step
    gets a fresh iterator over its own micro-batches)."""
    single_rank()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(1, use_cudagraphable_rng=graph_safe_rng)
    bf16 = dtype == torch.bfloat16
    config = tiny_config(hidden_size=64, hidden_dropout=0.1, attention_dropout=attention_dropout, params_dtype=dtype,
                         bf16=bf16, gradient_accumulation_fusion=True)
    model = tiny_gpt(config, vocab_size=128, share_embeddings_and_output_weights=False).to(device)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-3, weight_decay=0.1, clip_grad=1.0, bf16=bf16),
                                       [model])
    config.finalize_model_grads_func = finalize_model_grads  # the schedule calls it, as in training
    config.grad_scale_func = optimizer.scale_loss

    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps * num_microbatches):
        tokens = torch.randint(0, 128, (2, 17), generator=gen)
        batches.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                        "position_ids": torch.arange(16).expand(2, 16).contiguous()})

    fbf = wrap(forward_backward_no_pipelining) if wrap else forward_backward_no_pipelining
    if one_iterator:
        stream, schedule = iter(batches), fbf
        fbf = lambda **kw: schedule(**dict(kw, data_iterator=[stream]))  # noqa: E731
    return [train_step(model, optimizer, batches[i * num_microbatches:(i + 1) * num_microbatches], schedule=fbf,
                       finalize=None)[0] for i in range(steps)]


def test_wrapper_reproduces_eager_training():
    reference = train_losses(6)
    graphed = train_losses(6, wrap=lambda f: FullCudaGraphWrapper(f, 2, graph_factory=ReexecutingGraph))
    assert graphed == reference  # same kernels on the same inputs: bitwise on CPU
    assert len(set(reference)) == 6  # every step saw new data


def test_reading_ahead_from_one_iterator_reproduces_eager_training():
    """As in training, one iterator for the run: each replayed step reads the next step's micro-batches
    while the device replays, and the losses are still bitwise eager training's."""
    reference = train_losses(6, one_iterator=True)
    graphed = train_losses(6, wrap=lambda f: FullCudaGraphWrapper(f, 2, graph_factory=ReexecutingGraph),
                           one_iterator=True)
    assert graphed == reference == train_losses(6)


def test_the_next_step_is_read_during_the_replay():
    """Order kept, the next step's micro-batches taken from the iterator before the step returns, the end of
    the data met one step later, and a read-ahead dropped when the step is given another iterator."""
    seen, taken = [], []

    def fbf(*, data_iterator, num_microbatches, **kw):
        seen.append([int(next(data_iterator)["x"]) for _ in range(num_microbatches)])
        return []

    def source(values):
        for v in values:
            taken.append(v)
            yield {"x": torch.tensor(v)}

    w = FullCudaGraphWrapper(fbf, 1, graph_factory=ReexecutingGraph)
    it = source(range(10))
    step = lambda it: w(forward_step_func=None, data_iterator=it, model=[torch.nn.Linear(1, 1)],  # noqa: E731
                        num_microbatches=2)
    step(it)  # warm-up: eager
    assert taken == [0, 1]
    step(it)  # capture, then the next step's read ahead
    assert taken == [0, 1, 2, 3, 4, 5]
    step(it)
    assert taken[-1] == 7
    step(it)
    step(it)  # replays 8, 9; reading ahead meets the end
    assert seen == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    with pytest.raises(StopIteration):
        step(it)
    step(source(range(20, 24)))  # a new iterator: nothing read ahead of it yet
    other = source(range(30, 34))
    step(other)  # its first step; the read-ahead of the previous iterator (22, 23) is dropped
    assert seen[-2:] == [[20, 21], [30, 31]]


def test_replay_without_refilling_the_buffers_would_differ():
    """Guards the test above: a wrapper that kept the captured micro-batches would train differently."""
    class Stale(StaticBatches):
        def load(self, batches):
            return super().load(batches) if self.buffers is None else self.buffers

    import megatron.core.full_cuda_graph as fcg
    original = fcg.StaticBatches
    fcg.StaticBatches = Stale
    try:
        stale = train_losses(5, wrap=lambda f: FullCudaGraphWrapper(f, 2, graph_factory=ReexecutingGraph))
    finally:
        fcg.StaticBatches = original
    assert stale != train_losses(5)


def test_static_batches_refuse_shape_changes():
    static = StaticBatches(torch.device("cpu"))
    static.load([{"tokens": torch.zeros(2, 8, dtype=torch.long), "n": 3}])
    with pytest.raises(RuntimeError, match="fixed-shape"):
        static.load([{"tokens": torch.zeros(2, 9, dtype=torch.long), "n": 3}])
    with pytest.raises(RuntimeError, match="baked into the captured graph"):
        static.load([{"tokens": torch.zeros(2, 8, dtype=torch.long), "n": 4}])
    with pytest.raises(RuntimeError, match="micro-batches"):
        static.load([])


def test_eval_and_warmup_run_eagerly():
    calls = []

    def fbf(**kw):
        calls.append(kw["forward_only"])
        return []

    events = []

    class NoGraph:
        def warmup(self, fn):
            events.append("warmup")
            return fn()

        def capture(self, fn):
            raise AssertionError("must not capture during warm-up or evaluation")

    w = FullCudaGraphWrapper(fbf, 2, graph_factory=NoGraph)
    for forward_only in (False, True, False, True):
        w(forward_step_func=None, data_iterator=iter([]), model=[torch.nn.Linear(1, 1)], num_microbatches=1,
          forward_only=forward_only)
    assert calls == [False, True, False, True]
    # Training warm-up steps run through the graph object (on the capture stream), evaluation does not.
    assert events == ["warmup", "warmup"]


def test_replayed_loss_check_names_the_flag():
    from megatron.training.train_step import _check_losses_finite
    single_rank()
    _check_losses_finite([{"lm loss": torch.tensor([3.0, 16.0])}])
    with pytest.raises(RuntimeError, match="no-check-for-nan-in-loss-and-grad"):
        _check_losses_finite([{"lm loss": torch.tensor([3.0, 16.0])}, {"lm loss": torch.tensor([float("nan"), 16.0])}])


def test_losses_to_host_keeps_the_layout():
    from megatron.training.train_step import _losses_to_host
    dicts = [{"lm loss": torch.tensor([3.0, 16.0]), "n": 2}, {"lm loss": torch.tensor([1.0, 8.0])}]
    assert _losses_to_host(dicts)() is dicts  # CPU: nothing to copy


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_cpu_run_is_refused_before_the_first_step():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        FullCudaGraphWrapper(lambda **kw: [], 3)

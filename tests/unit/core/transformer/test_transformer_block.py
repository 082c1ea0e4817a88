"""Pipeline layer assignment: even, virtual (interleaved), uneven first/last, embedding/loss slots.
Activation recompute: the flags reach the config, and losses and gradients are the same with and without."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_block import get_num_layers_to_build, get_transformer_layer_offset
from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
from tests.fixtures.tiny_gpt import cpu_reference_config as _gqa_cfg
from tests.fixtures.tiny_gpt import short_batch as _batch
from tests.fixtures.tiny_gpt import short_gpt as _gpt
from tests.fixtures.tiny_gpt import tiny_config, tiny_gpt


@pytest.fixture
def pp():
    def set_pp(size):
        ps.set_pipeline_model_parallel_world_size(size)
    yield set_pp
    ps.set_pipeline_model_parallel_world_size(None)


def _layout(cfg, pp_size, vp_size=1):
    return [[(get_num_layers_to_build(cfg, vp, r), get_transformer_layer_offset(cfg, vp, r))
             for r in range(pp_size)] for vp in range(vp_size)]


def _cfg(num_layers, pp_size, **kw):
    return tiny_config(num_layers=num_layers, hidden_size=8, num_attention_heads=2,
                       pipeline_model_parallel_size=pp_size, **kw)


def test_even_and_virtual(pp):
    pp(2)
    assert _layout(_cfg(4, 2), 2) == [[(2, 0), (2, 2)]]
    # 8 layers, PP=2, VPP=2: rank 0 builds 0-1 and 4-5, rank 1 builds 2-3 and 6-7.
    cfg = _cfg(8, 2, virtual_pipeline_model_parallel_size=2)
    assert _layout(cfg, 2, 2) == [[(2, 0), (2, 2)], [(2, 4), (2, 6)]]


def test_uneven_first_last(pp):
    pp(3)
    cfg = _cfg(7, 3, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=2)
    assert _layout(cfg, 3) == [[(1, 0), (4, 1), (2, 5)]]


def test_account_for_embedding_and_loss(pp):
    pp(4)
    cfg = _cfg(6, 4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    assert _layout(cfg, 4) == [[(1, 0), (2, 1), (2, 3), (1, 5)]]


def test_custom_layout(pp):
    """--pipeline-model-parallel-layout: each stage's layers as written, a stage may hold none; its entry count
    sets the virtual stages per rank (interleaved order: entry i is virtual stage i // PP of rank i % PP)."""
    pp(4)
    cfg = _cfg(32, 4, pipeline_model_parallel_layout="Et*9|t*9|t*9|t*5L")
    assert _layout(cfg, 4) == [[(9, 0), (9, 9), (9, 18), (5, 27)]]
    pp(2)
    cfg = _cfg(6, 2, pipeline_model_parallel_layout="E|t*2|(tt|)*1t,tL")
    assert cfg.virtual_pipeline_model_parallel_size == 2
    assert _layout(cfg, 2, 2) == [[(0, 0), (2, 0)], [(2, 2), (2, 4)]]


@pytest.mark.parametrize("layout,needle", [
    ("Et*3|tL", "places 4 transformer layers (t); --num-layers is 5"),
    ("tE*2|t*3L", "the embedding (E) must open the first stage"),
    ("Et*3|t|L", "3 stages, not a multiple of --pipeline-model-parallel-size (2)"),
    ("Et*3|tLt", "the loss (L) must close the last stage"),
    ("Et*3|tx*2L", "unknown symbol(s) ['x']"),
])
def test_custom_layout_errors_name_the_problem(pp, layout, needle):
    pp(2)
    with pytest.raises(ValueError) as e:
        _cfg(5, 2, pipeline_model_parallel_layout=layout)
    assert needle in str(e.value)


@pytest.mark.parametrize("size,kw", [(2, dict(num_layers=5)),
                                     (2, dict(num_layers=6, virtual_pipeline_model_parallel_size=2)),
                                     (3, dict(num_layers=6, num_layers_in_first_pipeline_stage=1))])
def test_layers_that_do_not_divide_raise(pp, size, kw):
    pp(size)
    n = kw.pop("num_layers")
    with pytest.raises(ValueError):
        get_num_layers_to_build(_cfg(n, size, **kw), 0, 0)


BASE = ("--num-layers 3 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 2 --train-iters 3 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 63 --hidden-dropout 0.1 --attention-dropout 0.1").split()


VARIANTS = {
    "selective-default": "--recompute-activations",
    "selective-all": "--recompute-granularity selective --recompute-modules core_attn mlp layernorm",
    "full-uniform": "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
    "full-block": "--recompute-granularity full --recompute-method block --recompute-num-layers 2",
}


def _config(extra):
    args = validate_args(parse_args(argv=BASE + extra.split()))
    return core_transformer_config_from_args(args)


def _train_losses(config, steps=3):
    """Losses of a few AdamW steps on fixed data; dropout on, replayed identically by recompute."""
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    return adamw_losses(tiny_gpt(config, max_sequence_length=8, share_embeddings_and_output_weights=False), steps)


def adamw_losses(model, steps=3):
    """The losses of ``steps`` AdamW steps of ``model`` on one fixed batch of 2 x 8 tokens."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 8), generator=g)
    pos = torch.arange(8).expand(2, 8)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(ids, pos, None, labels=ids).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_flags_reach_config():
    c = _config(VARIANTS["selective-default"])
    assert c.recompute_granularity == "selective" and c.recompute_modules == ["core_attn"]
    c = _config(VARIANTS["selective-all"])
    assert c.recompute_modules == ["core_attn", "mlp", "layernorm"]
    c = _config(VARIANTS["full-block"])
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("full", "block", 2)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_recompute_losses_identical(name):
    reference = _train_losses(_config(""))
    # Recompute replays the same kernels on the same inputs with the same RNG state: bitwise equal on CPU.
    assert _train_losses(_config(VARIANTS[name])) == reference


def test_recompute_method_without_full_rejected():
    with pytest.raises(Exception, match="recompute"):
        _config("--recompute-method uniform")


S, B = 6, 2


def test_swiglu_model_and_full_recompute_same_grads():
    kw = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
    ids, pos = _batch()
    grads = []
    for extra in ({}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                  dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
                  dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"])):
        model = _gpt(_gqa_cfg(**kw, **extra), position_embedding_type="rope")
        loss = model(ids, pos, None, labels=ids)
        assert loss.shape == (B, S) and loss.dtype == torch.float32
        loss.mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    for g in grads[1:]:  # recompute replays the same math: equal up to fp32 rounding
        torch.testing.assert_close(g, grads[0], rtol=1e-5, atol=1e-7)

"""--transformer-impl, --attention-backend and --use-flash-attn: each mapping said once at start-up."""
import pytest

from megatron.training.arguments import ArgumentError, parse_args, validate_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --train-iters 5 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 127").split()


def _args(extra=""):
    return validate_args(parse_args(argv=BASE + extra.split()))


def test_default_is_local():
    assert _args().transformer_impl == "local"


def test_transformer_engine_is_mapped_and_said_once(capsys):
    args = _args("--transformer-impl transformer_engine")
    assert args.transformer_impl == "transformer_engine"
    out = capsys.readouterr().out
    assert out.count("--transformer-impl transformer_engine runs this project's fused torch layers: same "
                     "functions, different kernels") == 1


def test_local_says_nothing_about_transformer_engine(capsys):
    _args("--transformer-impl local")
    assert "transformer_engine" not in capsys.readouterr().out


@pytest.mark.parametrize("backend,kernel", [("fused", "cuDNN"), ("flash", "flash"), ("unfused", "math"),
                                            ("local", "picks")])
def test_attention_backends_are_mapped_to_sdpa_kernels(capsys, backend, kernel):
    assert _args(f"--attention-backend {backend}").attention_backend == backend
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("--attention-backend")]
    assert len(lines) == 1 and kernel in lines[0]


def test_use_flash_attn_selects_flash_backend():
    assert _args("--use-flash-attn").attention_backend == "flash"
    assert _args("--use-flash-attn --attention-backend flash").attention_backend == "flash"
    assert _args().attention_backend == "auto"
    with pytest.raises(ArgumentError, match="--use-flash-attn"):
        _args("--use-flash-attn --attention-backend unfused")

"""--transformer-impl and --use-flash-attn: explicit behaviour, never a silent substitute."""
import pytest

from megatron.training.arguments import ArgumentError, fast_path, parse_args, validate_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --train-iters 5 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 127").split()


def _args(extra=""):
    return validate_args(parse_args(argv=BASE + extra.split()))


def test_default_is_local():
    assert _args().transformer_impl == "local"


def test_transformer_engine_missing_names_flag(monkeypatch):
    monkeypatch.setattr(fast_path, "transformer_engine_installed", lambda: False)
    with pytest.raises(ArgumentError, match="--transformer-impl transformer_engine.*not installed.*local"):
        _args("--transformer-impl transformer_engine")


def test_transformer_engine_installed_but_not_integrated(monkeypatch):
    monkeypatch.setattr(fast_path, "transformer_engine_installed", lambda: True)
    with pytest.raises(NotImplementedError, match="--transformer-impl transformer_engine"):
        _args("--transformer-impl transformer_engine")


def test_te_probe_follows_import_machinery(monkeypatch):
    monkeypatch.setattr(fast_path.importlib.util, "find_spec", lambda name: None)
    assert not fast_path.transformer_engine_installed()
    monkeypatch.setattr(fast_path.importlib.util, "find_spec", lambda name: object())
    assert fast_path.transformer_engine_installed()


def test_use_flash_attn_selects_flash_backend():
    assert _args("--use-flash-attn").attention_backend == "flash"
    assert _args("--use-flash-attn --attention-backend flash").attention_backend == "flash"
    assert _args().attention_backend == "auto"
    with pytest.raises(ArgumentError, match="--use-flash-attn"):
        _args("--use-flash-attn --attention-backend unfused")

"""Megatron's older entry point of hybrid models: the same as pretrain_hybrid.py (`--hybrid-override-pattern`
is accepted as the older spelling of `--hybrid-layer-pattern`)."""
from pretrain_hybrid import model_provider, run  # noqa: F401  (model_provider: Megatron's module attribute)

if __name__ == "__main__":
    run()

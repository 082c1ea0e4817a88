"""Megatron Core names that exist only so that code written for Megatron Core runs unchanged.

Fixed-answer getters, decorators nothing here calls, version probes, typing Protocols and helpers this
project's own code has no use for live in this room, one file per host module (``_compat/utils.py``
holds the Megatron-only names of ``megatron/core/utils.py``). The room imports working code; no working
module imports it. Megatron's import paths reach it through the host module's lazy alias table
(``megatron.core.utils.lazy_names``), so ``from megatron.core.utils import X`` keeps working.
"""

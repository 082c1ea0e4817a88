"""Megatron-LM application names that exist only for scripts written against Megatron-LM.

The same rule as ``megatron/core/_compat``: this room imports working code, no working module imports
it, and Megatron's import paths reach it through the host module's lazy alias table.
"""

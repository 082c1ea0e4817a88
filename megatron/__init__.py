"""Megatron-LM-compatible training (megatron.core, megatron.training).

A namespace-extended package, as Megatron-LM's: add-ons installed under the same name (Megatron Energon
is `megatron.energon`) import next to it."""
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

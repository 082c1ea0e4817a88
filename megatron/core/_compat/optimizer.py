"""Megatron Core's ``megatron.core.optimizer`` names for the builders of its standard and MuP
``config_overrides`` (this project's own code calls them by their names in optimizer/config_overrides.py), and
the flag of Megatron's optional emerging-optimizers package (Muon and Lion are built in here).
Reached from ``megatron.core.optimizer`` through its lazy alias table.
"""
from megatron.core.optimizer.config_overrides import mup_config_overrides, standard_config_overrides

# Megatron's flag for its optional emerging-optimizers package (SOAP...): not installed; Muon and Lion are built in.
HAVE_EMERGING_OPTIMIZERS = False


get_standard_config_overrides = standard_config_overrides
get_mup_config_overrides = mup_config_overrides

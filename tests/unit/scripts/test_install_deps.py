"""scripts/install_deps.sh (what the README runs) installs every runtime package, wandb included:
the package list is computed by the script's own command substitution."""
import os
import re
import subprocess

from packaging.requirements import Requirement

from tests import ROOT


def _packages_the_script_installs():
    script = open(os.path.join(ROOT, "scripts", "install_deps.sh")).read()
    line = next(l for l in script.splitlines() if "pip install -q $(" in l)
    substitution = re.search(r"\$\((.*)\)\s*$", line).group(1)
    out = subprocess.run(["bash", "-c", substitution], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_install_deps_installs_wandb_and_only_valid_requirements():
    packages = _packages_the_script_installs()
    names = {Requirement(p).name for p in packages}  # raises on a stray comment or a malformed line
    assert "wandb" in names and "numpy" in names and "torch" not in names

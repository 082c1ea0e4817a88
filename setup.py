"""Install the package and build the C++ dataset index helpers (pybind11).

The helpers are optional at install time: from a source tree without a build they are compiled on
first use (see megatron.core.datasets.utils.compile_helpers).
"""
from setuptools import find_packages, setup

ext_modules = []
try:
    from pybind11.setup_helpers import Pybind11Extension

    ext_modules.append(
        Pybind11Extension(
            "megatron.core.datasets.helpers_cpp",
            ["megatron/core/datasets/helpers.cpp"],
            extra_compile_args=["-O3"],
        )
    )
except ImportError:  # pybind11 missing: helpers are built on first use instead
    pass

setup(
    name="megatron-lite",
    version="0.1.0",
    description="Megatron-LM compatible large-scale transformer pretraining",
    packages=find_packages(include=["megatron", "megatron.*"]),
    package_data={"megatron.training.arguments": ["megatron_flags_0.19.2.tsv"]},
    python_requires=">=3.10",
    install_requires=[line.split("#")[0].strip() for line in open("requirements.txt")
                      if line.split("#")[0].strip()],
    ext_modules=ext_modules,
    zip_safe=False,
)

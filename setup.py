"""Packaging glue that pyproject.toml cannot express: the kernel sources live in the repository's top-level
csrc/ (where nvcc, editors and the compile test find them) and ship inside the wheel as the package
``detcomm.csrc`` (found at run time with importlib.resources). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["detcomm", "detcomm.*"]) + ["detcomm.csrc"],
    package_dir={"detcomm.csrc": "csrc"},
    package_data={"detcomm": ["py.typed"], "detcomm.csrc": ["*.cu", "*.cuh"]},
)

"""Declares the C++ extensions only; all package metadata lives in pyproject.toml.

``seer_engine._C`` (the group suffix tree) needs pybind11. ``seer_engine._cpu_ops`` (the
CPU decode kernels) builds against torch, so it is declared only where torch is
importable at build time (``python setup.py build_ext --inplace``, or ``pip install
--no-build-isolation``); without it the engine runs plain torch ops.
"""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "seer_engine._C",
        ["csrc/suffix_tree.cpp"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    )
]
cmdclass = {"build_ext": build_ext}
try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    print("torch is not importable: seer_engine._cpu_ops (CPU decode kernels) is not built")
else:
    ext_modules.append(
        CppExtension(
            "seer_engine._cpu_ops",
            ["csrc/cpu_ops.cpp"],
            extra_compile_args=[
                "-O3",
                "-march=x86-64-v4",
                "-mtune=generic",
                "-ffp-contract=off",
                "-fopenmp",  # at::parallel_for runs serially without it (torch's libgomp at run time)
            ],
            extra_link_args=["-fopenmp"],
        )
    )
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)

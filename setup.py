"""Declares the C++ extensions only; all package metadata lives in pyproject.toml.

``seer_engine._C`` (the group suffix tree) needs pybind11. ``seer_engine._cpu_ops`` (the
CPU decode kernels) builds against torch, so it is declared only where torch is
importable at build time (``python setup.py build_ext --inplace``, or ``pip install
--no-build-isolation``). It is optional: where it does not compile (no compiler support
for x86-64-v4 or OpenMP, another architecture) the build goes on without it and the
engine runs plain torch ops.
"""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

OPTIONAL = "seer_engine._cpu_ops"

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
    from torch.utils.cpp_extension import BuildExtension, CppExtension, library_paths
except ImportError:
    print(f"torch is not importable: {OPTIONAL} (CPU decode kernels) is not built")
else:

    class OptionalBuild(BuildExtension):
        """Builds every extension; a failure of the optional CPU kernels is reported and the
        extension dropped (so an in-place build does not look for its library), not raised."""

        def build_extensions(self) -> None:
            self.failed: set[str] = set()
            super().build_extensions()
            self.extensions = [ext for ext in self.extensions if ext.name not in self.failed]

        def build_extension(self, ext) -> None:
            try:
                super().build_extension(ext)
            except Exception as e:  # compiler, linker or ninja errors all end the same way
                if ext.name != OPTIONAL:
                    raise
                self.failed.add(ext.name)
                print(
                    f"WARNING: {OPTIONAL} (CPU decode kernels) did not build ({e}); the engine runs torch ops"
                )

    ext_modules.append(
        CppExtension(
            OPTIONAL,
            ["csrc/cpu_ops.cpp"],
            extra_compile_args=[
                "-O3",
                "-march=x86-64-v4",  # AVX-512; loaded only where torch reports an AVX-512 CPU
                "-mtune=generic",
                "-ffp-contract=off",
                "-fopenmp",  # at::parallel_for runs serially without it (torch's libgomp at run time)
            ],
            # torch's libraries found without torch imported first (``import seer_engine._cpu_ops``)
            extra_link_args=["-fopenmp", *(f"-Wl,-rpath,{path}" for path in library_paths())],
        )
    )
    cmdclass = {"build_ext": OptionalBuild}

setup(ext_modules=ext_modules, cmdclass=cmdclass)

"""Packaging for vescale. The extension is built by CMake (see CMakeLists.txt)
against the torch that is already installed, so install without build isolation:

    pip install --no-build-isolation .

(`make build` does the same build in place for development.)
"""

import os
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        root = os.path.dirname(os.path.abspath(__file__))
        build_dir = os.path.join(root, "build")
        subprocess.check_call(["cmake", "-S", root, "-B", build_dir, "-G", "Ninja",
                               f"-DPython_EXECUTABLE={sys.executable}", "-DVESCALE_BUILD_TESTS=OFF"])
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "_C", "-j", str(os.cpu_count() or 2)])
        # CMake writes the module into vescale/; copy it where setuptools expects it.
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        built = [f for f in os.listdir(os.path.join(root, "vescale")) if f.startswith("_C.") and f.endswith(".so")]
        if os.path.abspath(os.path.dirname(target)) != os.path.join(root, "vescale"):
            self.copy_file(os.path.join(root, "vescale", built[0]), target)


setup(
    name="vescale",
    version="0.1.0",
    description="Train unmodified PyTorch models on a device mesh: a C++ DTensor engine behind a c10 dispatch key",
    packages=find_packages(include=["vescale", "vescale.*"]),
    ext_modules=[CMakeExtension("vescale._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["torch==2.13.0"],
)

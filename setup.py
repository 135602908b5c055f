"""Package discovery for the layout where the repository root is the `furcate` package.

pyproject.toml alone cannot say "every package under the root, prefixed with furcate." (find_packages names them
lang, runtime, ... and package-dir cannot rename found packages), so this computes the list: any folder below the
root with an __init__.py is shipped as furcate.<dotted path>, and a new subpackage cannot be forgotten. Folders
that are not part of the package (tests, benchmarks, examples, docs) are left out by name, and so is this script
(it lies in the root package's folder, so setuptools would ship it as furcate.setup).
"""

from __future__ import annotations

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

NOT_SHIPPED = ("tests", "benchmarks", "examples", "docs", "build", "dist")


def furcate_packages() -> list[str]:
    excluded = [pattern for name in NOT_SHIPPED for pattern in (name, f"{name}.*")]
    return ["furcate", *(f"furcate.{name}" for name in find_packages(where=".", exclude=excluded))]


class BuildPyWithoutSetupScript(build_py):
    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules = super().find_package_modules(package, package_dir)
        return [module for module in modules if module[:2] != ("furcate", "setup")]


# Non-Python files a package reads at run time: the native kernels' sources, built on the user's machine.
PACKAGE_DATA = {"furcate.runtime.kernels": ["csrc/*.c", "csrc/*.h", "csrc/*.cpp"]}

setup(package_dir={"furcate": "."}, packages=furcate_packages(), package_data=PACKAGE_DATA,
      cmdclass={"build_py": BuildPyWithoutSetupScript})

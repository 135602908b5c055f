"""C kernels built once per machine with the system compiler, for the CPU they run on, and cached on disk.

A kernel's library is keyed by its source (and the files it includes), the compiler (the file it runs), the flags
and the CPU (-march=native compiles for the CPU at hand), so another machine, compiler, flag set or edit builds its
own. It is compiled into a temporary file and moved into place, so a concurrent start never loads half a file.
Without a compiler, or where the build fails, load raises OSError or SubprocessError and the caller keeps its torch
path.

Where -fopenmp does not link (clang without libomp), the build is retried with -fopenmp-simd: the sources' vector
loops as before, their parallel loops on the calling thread (guarded by _OPENMP), and a warning says so. A build
the compiler refuses is remembered under the library's key (a .failed file beside where the library would be,
holding the compiler's errors), so later starts report that reason at once instead of compiling again; an edited
source, another compiler or other flags make another key, which builds afresh.

Each kernel's Python face declares its C entry points once, in a Binding (names, ctypes argument and return
types, limits, status texts and the structs they take); Binding.bind sets the library's ctypes types from it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from ..cache_folder import furcate_cache

if TYPE_CHECKING:
    import torch

Built = TypeVar("Built")

logger = logging.getLogger("furcate.native_build")

OPENMP = "-fopenmp"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", OPENMP, "-shared", "-fPIC")
# Variables that hold the kernels to fewer instructions than the CPU has (torch's own, oneDNN's, MKL's, ours).
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
              "FURCATE_NATIVE_FLAGS")
# What stands for OPENMP where it does not link: OpenMP's vector pragmas without its runtime library.
WITHOUT_OPENMP = "-fopenmp-simd"


def cache_dir() -> pathlib.Path:
    return furcate_cache() / "kernels"


def native_flags() -> tuple[str, ...]:
    """FLAGS and the user's FURCATE_NATIVE_FLAGS after them (say "-mno-avx512f": build for less than the CPU has,
    as a CPU without AVX-512 would)."""
    return FLAGS + tuple(os.environ.get("FURCATE_NATIVE_FLAGS", "").split())


def cpu_signature() -> str:
    """What the kernels run on: the CPU's model and flags, and the variables that hold torch, oneDNN, MKL or our
    builds to less of it (ISA_LIMITS), so that what was built, compiled or chosen under them is kept apart."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = ["unknown"]
    limits = [f"{name}={os.environ[name]}" for name in ISA_LIMITS if os.environ.get(name)]
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags", "unknown"))})
                     + limits)


def included_files(source: pathlib.Path) -> list[pathlib.Path]:
    """source and the files beside it that it includes (#include "name"), and those that they include, each once:
    what a build compiles."""
    found: list[pathlib.Path] = []
    pending = [source]
    while pending:
        path = pending.pop(0)
        if path in found:
            continue
        found.append(path)
        names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), flags=re.MULTILINE)
        pending.extend(path.parent / name for name in names)
    return found


def source_texts(source: pathlib.Path) -> list[str]:
    """The texts of what a build of source compiles (included_files)."""
    return [path.read_text() for path in included_files(source)]


def compiler_identity(compiler: str) -> str:
    """compiler's name and the file it runs (links followed), with its size and time: an upgraded compiler under
    the same name is another key, so a build it refused before is tried again. Just the name where it is not
    found (the build then fails, and is not remembered)."""
    found = shutil.which(compiler)
    if found is None:
        return compiler
    path = pathlib.Path(found).resolve()
    try:
        facts = path.stat()
    except OSError:
        return compiler
    return f"{compiler}\0{path}\0{facts.st_size}\0{facts.st_mtime_ns}"


def library_path(source: pathlib.Path, compiler: str, flags: tuple[str, ...]) -> pathlib.Path:
    """Where source's library built by compiler with flags lies, keyed by what it is built from (its failure
    marker beside it)."""
    parts = [*source_texts(source), compiler_identity(compiler), *flags, cpu_signature()]
    key = hashlib.sha256("\0".join(parts).encode())
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


class RememberedBuildFailure(subprocess.SubprocessError):
    """A build that failed at an earlier start, as its marker file remembers it: stderr holds the compiler's
    errors then."""

    def __init__(self, marker: pathlib.Path, stderr: str) -> None:
        super().__init__(f"the build failed before (remembered in {marker}): {stderr}")
        self.marker, self.stderr = marker, stderr


def failure_marker(target: pathlib.Path) -> pathlib.Path:
    """Where a failed build of target is remembered: beside it, under the same key."""
    return target.with_suffix(".failed")


def compile_into(source: pathlib.Path, compiler: str, flags: tuple[str, ...], target: pathlib.Path,
                 libraries: tuple[str, ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = pathlib.Path(scratch) / target.name
        subprocess.run([compiler, *flags, str(source), *libraries, "-o", str(built)], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(built, target)


def without_openmp(flags: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(WITHOUT_OPENMP if flag == OPENMP else flag for flag in flags)


def build(source: pathlib.Path, compiler: str, flags: tuple[str, ...], target: pathlib.Path,
          libraries: tuple[str, ...] = ()) -> None:
    """Compile source into target; libraries (-L and -l options) come after the source, where a linker that
    links only libraries in use (--as-needed) still sees what the source needs from them. Where the compiler's
    errors speak of OpenMP (no libomp to link, no -fopenmp at all), it is built again without OpenMP."""
    try:
        compile_into(source, compiler, flags, target, libraries)
    except subprocess.CalledProcessError as error:
        said = [line.strip() for line in (error.stderr or "").splitlines() if "omp" in line.lower()]
        if OPENMP not in flags or not said:  # errors of the source's own: the same without OpenMP
            raise
        logger.warning("%s does not build with OpenMP (%s): built with %s, its loops on one thread", source.name,
                       said[0], WITHOUT_OPENMP)
        compile_into(source, compiler, without_openmp(flags), target, libraries)


def build_once(source: pathlib.Path, compiler: str, flags: tuple[str, ...], target: pathlib.Path,
               libraries: tuple[str, ...] = ()) -> None:
    """build() unless target is built; where the compiler refuses the source, its errors are kept in target's
    failure marker, and while that is there this raises RememberedBuildFailure without compiling. A compiler that
    is missing or ran out of time is not remembered: the next start tries again."""
    if target.exists():
        return
    marker = failure_marker(target)
    if marker.exists():
        raise RememberedBuildFailure(marker, marker.read_text())
    try:
        build(source, compiler, flags, target, libraries)
    except subprocess.CalledProcessError as error:
        remember_failure(marker, failure_reason(error))
        raise


def remember_failure(marker: pathlib.Path, reason: str) -> None:
    """reason written into marker whole (moved into place, as a library is), so a concurrent start never reads
    half of it."""
    marker.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=marker.parent, suffix=".tmp", delete=False) as file:
        file.write(reason)
    os.replace(file.name, marker)


@dataclass(frozen=True)
class Entry:
    """One C entry point of a kernel: its name, its arguments' ctypes types and its return type (None: void)."""

    name: str
    argtypes: tuple[Any, ...] = ()
    restype: Any = None


@dataclass(frozen=True)
class Binding:
    """A kernel's C face, declared once in its Python face: its entry points; its limits (the values of the C
    sources' #defines of those names); the texts of the statuses its entry points return; and the ctypes
    Structures standing for the C structs (typedef names) its entry points take."""

    entries: tuple[Entry, ...]
    limits: Mapping[str, int] = field(default_factory=dict)
    errors: Mapping[int, str] = field(default_factory=dict)
    structs: Mapping[str, type[ctypes.Structure]] = field(default_factory=dict)

    def bind(self, lib: ctypes.CDLL) -> ctypes.CDLL:
        """lib with each entry point's argtypes and restype set from the table."""
        for entry in self.entries:
            function = getattr(lib, entry.name)
            function.argtypes, function.restype = list(entry.argtypes), entry.restype
        return lib


def load(source: pathlib.Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """source built with native_flags() and extra_flags ($CC, else cc), building it if needed."""
    compiler, flags = os.environ.get("CC", "cc"), native_flags() + extra_flags
    target = library_path(source, compiler, flags)
    build_once(source, compiler, flags, target)
    return ctypes.CDLL(str(target))


def torch_flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What a C++ library of torch ops compiles with (this torch's headers and ABI; its version names the build, so
    another torch builds its own) and links with (its libraries)."""
    import torch

    root, abi = pathlib.Path(torch.__file__).parent, int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = ("-std=c++17", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DFURCATE_TORCH={torch.__version__}",
                     f"-I{root / 'include'}")
    return compile_flags, (f"-L{root / 'lib'}", "-ltorch", "-ltorch_cpu", "-lc10")


def load_torch_ops(source: pathlib.Path, linked: tuple[pathlib.Path, ...] = ()) -> pathlib.Path:
    """source, a C++ file registering torch ops, built ($CXX, else c++) with the C libraries `linked` (load's,
    calling into them) and loaded into torch's dispatcher; the library's path. Raises OSError or SubprocessError
    as load does."""
    import torch

    compile_flags, torch_libraries = torch_flags()
    libraries = (*map(str, linked), *(f"-Wl,-rpath,{path.parent}" for path in linked), *torch_libraries)
    compiler, flags = os.environ.get("CXX", "c++"), native_flags() + compile_flags
    target = library_path(source, compiler, flags + libraries)
    build_once(source, compiler, flags, target, libraries)
    try:
        torch.ops.load_library(str(target))
    except RuntimeError as error:  # the dispatcher refused it (say a schema that disagrees)
        raise OSError(str(error)) from error
    return target


def register_op_kernel(library: torch.library.Library, name: str, source: pathlib.Path,
                       python_kernel: Callable[..., object], logger: logging.Logger,
                       linked: tuple[pathlib.Path, ...] = ()) -> bool:
    """Give the op furcate::`name` (defined in library) its CPU kernel: source's C++ (load_torch_ops; it registers
    itself) where it builds, so that a compiled graph calls it without a trip into Python (~8 us a call), else
    python_kernel (also with FURCATE_NATIVE_OPS=0). Whether the C++ kernel runs."""
    built = load_or_reason("FURCATE_NATIVE_OPS", lambda: load_torch_ops(source, linked), logger,
                           f"furcate::{name} runs its Python kernel")
    if isinstance(built, str):
        library.impl(name, python_kernel, "CPU")
    return not isinstance(built, str)


def available_with_op(library: object, native_op: Callable[[], bool]) -> bool:
    """Whether a C kernel is built (library: its library, or why there is none); where it is, its op is given its
    CPU kernel first (native_op, cached, registers it)."""
    if isinstance(library, str):
        return False
    native_op()
    return True


def failure_reason(error: OSError | subprocess.SubprocessError) -> str:
    """What a failed build or load says: the compiler's errors where it ran."""
    return (getattr(error, "stderr", None) or str(error)).strip()


def load_or_reason(variable: str, load: Callable[[], Built], logger: logging.Logger, fallback: str) -> Built | str:
    """load()'s library, or why there is none: turned off by `variable`=0, or its build or load failed (logged
    as a warning that names the `fallback` running instead)."""
    if os.environ.get(variable, "1") == "0":
        return f"turned off by {variable}=0"
    try:
        return load()
    except (OSError, subprocess.SubprocessError) as error:
        reason = failure_reason(error)
        remembered = (f" (remembered from an earlier start; remove {error.marker} to build again)"
                      if isinstance(error, RememberedBuildFailure) else "")
        logger.warning("%s%s: %s", fallback, remembered, reason)
        return f"could not build or load it: {reason}"

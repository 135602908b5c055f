"""The native kernels' sources (runtime/kernels/csrc/) and their faces: every C source and C++ op compiles without a
warning (-Wall -Wextra -Werror) with the system compilers and with clang where it is installed, with OpenMP and
without it (-fopenmp-simd, what native_build builds where -fopenmp does not link); each header compiles on its
own; a build the compiler refuses is remembered, so a later load reports it without compiling, and a library that
-fopenmp cannot link builds without OpenMP; and each face's binding table agrees with the C sources (entry points'
arguments and returns, limits, the structs' layout, status texts) and sets the library's ctypes types."""

from __future__ import annotations

import ctypes
import logging
import pathlib
import re
import shutil
import stat
import subprocess
from types import ModuleType

import pytest

from furcate.runtime.kernels import block_gemv, fused_elementwise, native_build, paged_attention

CSRC = pathlib.Path(native_build.__file__).parent / "csrc"
FACES = (paged_attention, block_gemv, fused_elementwise)
WARNINGS = ("-Wall", "-Wextra", "-Werror")
# Each C source's builds: the flags its face adds, one set per vector path the kernel has.
C_BUILDS = {"paged_attention.c": [(), ("-mno-avx512bf16",)],
            "block_gemv.c": [(), ("-mno-avx512f",), ("-mno-avx", "-mno-avx2")],
            "fused_elementwise.c": [fused_elementwise.FLAGS]}
# What a header needs defined to compile alone beyond -march=native: the bfloat16 path's instructions.
HEADER_FLAGS = {"paged_attention_bf16.h": ("-mavx512f", "-mavx512bw", "-mavx512bf16")}
COMPILE = tuple(flag for flag in native_build.FLAGS if flag != "-shared")


def clang(cxx: bool = False) -> str:
    """clang (clang++ for C++) on PATH, or a versioned one (clang-19 .. clang-14); skips the test without."""
    base = "clang++" if cxx else "clang"
    for name in (base, *(f"{base}-{version}" for version in range(19, 13, -1))):
        if shutil.which(name):
            return name
    pytest.skip(f"no {base} on PATH: the sources are checked with the system compiler only")


def compiled(compiler: str, *args: str) -> None:
    done = subprocess.run([compiler, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{compiler} {' '.join(args)}:\n{done.stderr}"


def test_every_source_has_its_builds_listed():
    """A new C source joins C_BUILDS, so that the checks below cover it."""
    assert sorted(C_BUILDS) == sorted(path.name for path in CSRC.glob("*.c"))


def c_cases() -> list[tuple[str, tuple[str, ...], str]]:
    """Every C source's builds with OpenMP, and its native build without (what native_build falls back to)."""
    cases = [(name, extra, native_build.OPENMP) for name, builds in C_BUILDS.items() for extra in builds]
    return cases + [(name, builds[0], native_build.WITHOUT_OPENMP) for name, builds in C_BUILDS.items()]


@pytest.mark.parametrize("compiler", ["cc", "clang"])
@pytest.mark.parametrize("name, extra, openmp", c_cases(), ids=lambda value: " ".join(value)
                         if isinstance(value, tuple) else value)
def test_c_sources_compile_without_warnings(compiler, name, extra, openmp, tmp_path):
    compiler = clang() if compiler == "clang" else compiler
    flags = COMPILE if openmp == native_build.OPENMP else native_build.without_openmp(COMPILE)
    compiled(compiler, *flags, *extra, *WARNINGS, "-c", str(CSRC / name), "-o", str(tmp_path / "kernel.o"))


def op_flags() -> tuple[str, ...]:
    """torch_flags()'s compile flags with torch's headers as system headers (their own warnings are not the
    sources') and warnings left on (the build itself passes -w)."""
    flags, _ = native_build.torch_flags()
    return tuple(f"-isystem{flag[2:]}" if flag.startswith("-I") else flag for flag in flags if flag != "-w")


@pytest.mark.parametrize("compiler", ["c++", "clang++"])
@pytest.mark.parametrize("name", sorted(path.name for path in CSRC.glob("*.cpp")))
def test_cpp_ops_compile_without_warnings(compiler, name):
    """Checked for syntax and warnings only: each op's full build (seconds of torch's headers at -O3) is what the
    kernels' own tests load."""
    compiler = clang(cxx=True) if compiler == "clang++" else compiler
    compiled(compiler, "-fsyntax-only", *native_build.without_openmp(COMPILE), *op_flags(), *WARNINGS,
             str(CSRC / name))


@pytest.mark.parametrize("compiler", ["cc", "clang"])
@pytest.mark.parametrize("name", sorted(path.name for path in CSRC.glob("*.h")))
def test_each_header_compiles_on_its_own(compiler, name):
    """Each header includes what it uses. Its static functions are for the file that includes it, so unused ones
    are no warning here."""
    compiler = clang() if compiler == "clang" else compiler
    compiled(compiler, "-fsyntax-only", *native_build.without_openmp(COMPILE), *HEADER_FLAGS.get(name, ()),
             *WARNINGS, "-Wno-unused-function", "-x", "c", str(CSRC / name))


def counting_compiler(tmp_path: pathlib.Path, refuse_openmp: bool = False) -> pathlib.Path:
    """A $CC that records each call's arguments (a line each in calls.txt) and runs cc; with refuse_openmp, a
    call with -fopenmp fails as clang without libomp does."""
    script = tmp_path / "counting-cc"
    refusal = ('case " $* " in *" -fopenmp "*) echo "ld: cannot find -lomp: No such file or directory" >&2; '
               'exit 1;; esac\n') if refuse_openmp else ""
    script.write_text(f'#!/bin/sh\necho "$*" >> "{tmp_path / "calls.txt"}"\n{refusal}exec cc "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def calls(tmp_path: pathlib.Path) -> list[str]:
    path = tmp_path / "calls.txt"
    return path.read_text().splitlines() if path.exists() else []


def test_a_refused_build_is_remembered_and_not_compiled_again(tmp_path, monkeypatch):
    source = tmp_path / "broken.c"
    source.write_text("int broken(void) { return undeclared; }\n")
    compiler = counting_compiler(tmp_path)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("FURCATE_CACHE", str(tmp_path / "cache"))
    log = logging.getLogger("test_native_sources")
    first = native_build.load_or_reason("FURCATE_TEST_KERNEL", lambda: native_build.load(source), log, "no kernel")
    assert "undeclared" in first and len(calls(tmp_path)) == 1
    target = native_build.library_path(source, str(compiler), native_build.FLAGS)
    assert "undeclared" in native_build.failure_marker(target).read_text() and not target.exists()
    with pytest.raises(native_build.RememberedBuildFailure):
        native_build.load(source)
    second = native_build.load_or_reason("FURCATE_TEST_KERNEL", lambda: native_build.load(source), log, "no kernel")
    assert second == first and len(calls(tmp_path)) == 1  # the same reason, and the compiler never ran again
    source.write_text("int broken(void) { return 0; }\n")  # an edit is another key: built afresh
    assert native_build.load(source).broken() == 0 and len(calls(tmp_path)) == 2
    source.write_text("int broken(void) { return undeclared; }\n")
    compiler.write_text(compiler.read_text() + "# upgraded\n")  # another compiler under the same name: tried again
    assert native_build.library_path(source, str(compiler), native_build.FLAGS) != target
    with pytest.raises(subprocess.CalledProcessError):
        native_build.load(source)
    assert len(calls(tmp_path)) == 3


def test_without_openmp_a_kernel_builds_serially_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(counting_compiler(tmp_path, refuse_openmp=True)))
    monkeypatch.setenv("FURCATE_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="furcate.native_build"):
        lib = fused_elementwise.load()
    made = calls(tmp_path)
    assert len(made) == 2 and native_build.OPENMP in made[0].split()
    assert native_build.OPENMP not in made[1].split() and native_build.WITHOUT_OPENMP in made[1].split()
    assert "does not build with OpenMP" in caplog.text and "cannot find -lomp" in caplog.text
    assert lib.rms_norm.argtypes == list(fused_elementwise.BINDING.entries[0].argtypes)
    fused_elementwise.load()  # built now, under the key of the flags asked for: no third call
    assert len(calls(tmp_path)) == 2


def built(face: ModuleType) -> ctypes.CDLL:
    lib = face.library()
    if isinstance(lib, str):
        pytest.skip(f"{face.__name__}: {lib}")
    return lib


@pytest.mark.parametrize("face", FACES, ids=lambda face: face.__name__.rsplit(".", 1)[-1])
def test_the_library_takes_its_binding_tables_types(face):
    lib = built(face)
    for entry in face.BINDING.entries:
        function = getattr(lib, entry.name)
        assert function.argtypes == list(entry.argtypes), entry.name
        assert function.restype == entry.restype, entry.name


def sources_text(face: ModuleType) -> str:
    return "\n".join(native_build.source_texts(face.SOURCE))


C_TYPES = {"void": None, "int": ctypes.c_int}


@pytest.mark.parametrize("face", FACES, ids=lambda face: face.__name__.rsplit(".", 1)[-1])
def test_the_binding_table_agrees_with_the_c_sources(face):
    """Each entry point's prototype has as many parameters as the table's argtypes and its return type; each
    limit is the sources' #define; each status text is the C++ op's too."""
    text = sources_text(face)
    for entry in face.BINDING.entries:
        prototype = re.search(rf"^(\w+)\s+{entry.name}\(([^)]*)\);", text, flags=re.MULTILINE)
        assert prototype, f"no prototype of {entry.name}"
        returns, parameters = prototype.groups()
        count = 0 if parameters.strip() == "void" else len(parameters.split(","))
        assert count == len(entry.argtypes) and C_TYPES[returns] == entry.restype, entry.name
    for name, value in face.BINDING.limits.items():
        assert re.search(rf"^#define {name} {value}\b", text, flags=re.MULTILINE), f"{name} is not {value}"
    op_text = face.OP_SOURCE.read_text() if face.BINDING.errors else ""
    for status, reason in face.BINDING.errors.items():
        assert f'return "{reason}"' in op_text, f"status {status}"


@pytest.mark.parametrize("face", FACES, ids=lambda face: face.__name__.rsplit(".", 1)[-1])
def test_each_struct_has_its_c_layout(face, tmp_path):
    """The ctypes Structure's size and each field's offset are the C compiler's, from the header that declares
    the typedef."""
    for c_name, structure in face.BINDING.structs.items():
        header = next(path for path in native_build.included_files(face.SOURCE) if path.suffix == ".h"
                      and re.search(rf"}}\s*{c_name};", path.read_text()))
        fields = [name for name, _ in structure._fields_]
        probe = tmp_path / "probe.c"
        probe.write_text(f'#include <stddef.h>\n#include <stdio.h>\n#include "{header}"\nint main(void) {{\n'
                         f'    printf("%zu\\n", sizeof({c_name}));\n'
                         + "".join(f'    printf("%zu\\n", offsetof({c_name}, {name}));\n' for name in fields)
                         + "    return 0;\n}\n")
        compiled("cc", *WARNINGS, str(probe), "-o", str(tmp_path / "probe"))
        layout = subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True, check=True).stdout
        expected = [ctypes.sizeof(structure), *(getattr(structure, name).offset for name in fields)]
        assert [int(line) for line in layout.split()] == expected, c_name


def test_the_sources_hash_nested_includes(tmp_path):
    """A header that a header includes is part of a build's key: editing it rebuilds."""
    (tmp_path / "outer.h").write_text('#include "inner.h"\n')
    (tmp_path / "inner.h").write_text("#define VALUE 1\n")
    (tmp_path / "kernel.c").write_text('#include "outer.h"\nint value(void) { return VALUE; }\n')
    before = native_build.library_path(tmp_path / "kernel.c", "cc", native_build.FLAGS)
    (tmp_path / "inner.h").write_text("#define VALUE 2\n")
    assert native_build.library_path(tmp_path / "kernel.c", "cc", native_build.FLAGS) != before


def test_no_source_calls_gccs_shuffle_outside_the_portable_macro():
    """__builtin_shuffle is GCC's alone: clang builds through paged_attention_vec.h's SHUFFLE."""
    for path in CSRC.iterdir():
        uses = [line for line in path.read_text().splitlines() if "__builtin_shuffle(" in line]
        portable = [line for line in uses if line.startswith("#define SHUFFLE(")]
        assert uses == portable and len(portable) <= (path.name == "paged_attention_vec.h"), path.name


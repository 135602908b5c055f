"""The installable package: the wheel built from the checkout holds every subpackage and nothing else (no tests,
benchmarks, examples or docs), and installed without -e into a fresh virtual environment (the dependencies reused
from this one, no network) it runs the default model through furcate.Engine, a @function program and the
`furcate serve` console script. And pytest imports the checkout only as furcate, never a second copy under the
checkout folder's name.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import requests

from furcate.runtime.server.server_process import ServerProcess

CHECKOUT = Path(__file__).resolve().parents[1]
NOT_SHIPPED = ("tests", "benchmarks", "examples", "docs")
# Small and cheap: one short greedy answer, no grammar backends built, one thread each for the two engines that
# start side by side (the child's and the server's).
ENGINE_ARGS = {"max_total_tokens": 1024, "grammar_backend": "none", "torch_num_threads": 1}
FEW_SHOT = "The capital of France is Paris.\nThe capital of Germany is Berlin.\nThe capital of Italy is Rome.\n"
PROMPT = FEW_SHOT + "The capital of Japan is"
SAMPLING = {"max_new_tokens": 5, "stop": "\n", "temperature": 0}
# Run by the fresh environment's interpreter from a temporary folder: the engine's greedy answer to PROMPT and
# the same answer through a program, and where furcate was imported from.
CHILD = f"""
import json
import sys

import furcate
from furcate import Engine, function, gen


@function
def capital(s):
    s += {PROMPT!r} + gen("answer", max_tokens=5, stop="\\n")


with Engine("default", **{ENGINE_ARGS!r}) as engine:
    direct = engine.generate({PROMPT!r}, {SAMPLING!r})["text"]
    program = capital.run(temperature=0, backend=engine)["answer"]
print(json.dumps({{"furcate": furcate.__file__, "direct": direct, "program": program}}))
"""


def shipped_folders() -> dict[Path, str]:
    """Each folder of the checkout that belongs to the package, with its path inside the wheel: the root, and
    below it every folder with an __init__.py whose parent belongs too, except the folders that are not shipped."""
    found = {CHECKOUT: "furcate"}
    for folder, subfolders, _ in os.walk(CHECKOUT):
        here = Path(folder)
        subfolders[:] = [name for name in subfolders if (here / name / "__init__.py").is_file()
                         and not (here == CHECKOUT and name in NOT_SHIPPED)]
        found.update({here / name: f"{found[here]}/{name}" for name in subfolders})
    return found


def expected_wheel_files() -> set[str]:
    """Every file of the package folders: modules, and in subpackages any data file beside them or in a data folder
    below them (a template, or the kernels' sources in runtime/kernels/csrc/, read at run time must ship). The
    root's other files (README, pyproject.toml, setup.py) are the project's, not the package's."""
    files = set()
    for folder, inside in shipped_folders().items():
        for path in folder.iterdir():
            if path.name.startswith(".") or path.name == "__pycache__":
                continue
            if path.is_dir() and folder != CHECKOUT and not (path / "__init__.py").is_file():
                files |= {f"{inside}/{data.relative_to(folder)}" for data in path.rglob("*") if data.is_file()}
            elif path.is_file() and not (folder == CHECKOUT and (path.suffix != ".py" or path.name == "setup.py")):
                files.add(f"{inside}/{path.name}")
    return files


def clean_environment() -> dict[str, str]:
    """This process's environment without PYTHONPATH, which may point at the checkout (the fresh environment
    must import the installed wheel only)."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def run(command: list[str], cwd: Path) -> str:
    """The command's stdout, run outside the checkout (`python -m` puts the working folder on sys.path)."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=clean_environment(), cwd=cwd)
    assert done.returncode == 0, f"{command[:4]} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the checkout: an in-tree build writes build/ into the tree it builds, and
    setuptools packs whatever an earlier build left in build/lib, so a copy builds exactly what the checkout holds.
    No build isolation (it would download setuptools): the dev extra installs it."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(CHECKOUT, source, ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__"))
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation",
         "-w", str(root / "dist"), str(source)], cwd=root)
    (built,) = (root / "dist").glob("furcate-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh virtual environment with the wheel installed (not editable). A .pth file puts this environment's
    site-packages on its path, so the dependencies are reused without network; a .pth file's plain paths are only
    appended to sys.path (the .pth files inside them do not run), so this environment's editable install of the
    checkout stays inactive there."""
    venv = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=venv)
    python = str(venv / "bin" / "python")
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=venv).strip())
    (purelib / "reused_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # --ignore-installed: the editable install's metadata is visible there too, and is neither this install's
    # business nor to be uninstalled.
    run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)], cwd=venv)
    return venv


def test_the_wheel_holds_every_subpackage_and_nothing_else(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = {name for name in archive.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert {name.split("/")[1] for name in names if name.count("/") > 1} & set(NOT_SHIPPED) == set()
    expected = expected_wheel_files()
    assert {"furcate/runtime/disaggregation/__init__.py", "furcate/runtime/distributed/__init__.py"} <= expected
    assert names == expected, f"missing: {sorted(expected - names)}, unexpected: {sorted(names - expected)}"


def test_the_installed_wheel_runs_engine_program_and_server(venv, default_model_dir, tmp_path, monkeypatch):
    """From a temporary folder, without PYTHONPATH: one child runs the engine and the program while `furcate serve`
    (the environment's console script) starts beside it; all three give the same greedy answer."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the server inherits this process's environment
    child = subprocess.Popen([str(venv / "bin" / "python"), "-c", CHILD], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=clean_environment())
    try:
        with ServerProcess("default", ENGINE_ARGS, launcher=(str(venv / "bin" / "furcate"),)) as server:
            response = requests.post(f"{server.url}/generate", json={"text": PROMPT, "sampling_params": SAMPLING},
                                     timeout=120)
        out, err = child.communicate(timeout=600)
    finally:
        child.kill()
    assert child.returncode == 0, err[-4000:]
    result = json.loads(out.splitlines()[-1])
    imported_from = Path(result["furcate"]).resolve()
    assert imported_from.is_relative_to(venv.resolve()) and not imported_from.is_relative_to(CHECKOUT)
    assert "Tokyo" in result["direct"], result
    assert result["program"] == result["direct"]
    assert response.status_code == 200, response.text
    assert response.json()["text"] == result["direct"]


def canonical_name(path: Path) -> str | None:
    """The one name a module of the checkout may be imported under: furcate.<dotted path> for the package, the
    bare name for the test helpers (tests/ is on sys.path), benchmarks.<name> for the benchmarks; None for the
    files that no test imports (examples run as scripts, setup.py)."""
    parts = path.relative_to(CHECKOUT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    if parts[:1] == ("tests",):
        return ".".join(parts[1:])
    if parts[:1] == ("benchmarks",):
        return ".".join(parts)
    if parts[:1] in {(name,) for name in NOT_SHIPPED} or parts == ("setup",):
        return None
    return ".".join(("furcate", *parts))


def in_checkout_source(path: Path) -> bool:
    """A file of the checkout's own source: not of a virtual environment made inside the clone (as the README's
    commands make .venv), nor of any other hidden folder."""
    if not path.is_relative_to(CHECKOUT) or path.is_relative_to(Path(sys.prefix).resolve()):
        return False
    return not path.relative_to(CHECKOUT).parts[0].startswith(".")


def test_no_module_of_the_checkout_is_imported_under_a_second_name():
    """By now pytest has imported every collected test module and what they import."""
    # Relative __file__ values name no file (torch.ops says "_ops.py").
    of_checkout = {name: Path(module.__file__).resolve() for name, module in list(sys.modules.items())
                   if os.path.isabs(getattr(module, "__file__", None) or "") and name != "__main__"
                   and in_checkout_source(Path(module.__file__).resolve())}
    assert __name__ in of_checkout  # this very module: the check sees the test modules
    assert {name: str(path) for name, path in of_checkout.items() if name != canonical_name(path)} == {}

"""Fixtures every test directory shares (pytest loads this file for any test under the repository)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def _fill(directory: Path) -> None:
    """Write one file into ``directory`` until its file system has no byte left."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    block = b"\0" * 4096
    try:
        while True:
            os.write(fd, block)
    except OSError as err:
        if err.errno != 28:  # ENOSPC is the point; anything else is a broken fixture
            raise
    finally:
        os.close(fd)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``small_disk("512k")``: a real tmpfs of that size, unmounted after the test; ``full=True`` fills it (one file,
    ``filler``) so that no write fits. Mounting needs root or CAP_SYS_ADMIN: the test is skipped with the reason
    otherwise (issue #22: every command that writes is checked on a full disk)."""
    mounted: list[Path] = []

    def mount(size: str, *, full: bool = False) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command: cannot make a small real file system for a full disk")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs for a full disk (needs root): {done.stderr.strip()}")
        mounted.append(where)
        if full:
            _fill(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


ROOT = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def repo_wheels(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., list[Path]]:
    """``repo_wheels("galva-schema", ...)``: the wheels pip builds from those ``packages/`` directories, built once
    per session and shared by the tests that install into a fresh venv. They are built with this environment's build
    backends (``--no-build-isolation``, as setup.sh installs): no isolated environment that installs hatchling or
    scikit-build-core again for each directory, and galva-search rebuilds in its persistent build directory (where
    setup.sh left the compiled core) only what changed."""
    directory = tmp_path_factory.mktemp("wheels")
    built: dict[str, Path] = {}

    def build(*names: str) -> list[Path]:
        missing = [name for name in names if name not in built]
        if missing:
            done = subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-build-isolation", "--no-deps",
                 "--disable-pip-version-check", "--wheel-dir", str(directory),
                 *(str(ROOT / "packages" / name) for name in missing)],
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-3000:]
            for name in missing:
                (built[name],) = directory.glob(f"{name.replace('-', '_')}-*.whl")
        return [built[name] for name in names]

    return build


def pytest_collection_finish(session: pytest.Session) -> None:
    """Import the heavy libraries' lazily loaded parts once, here, before any test forks ranks.

    The first access to ``transformers.models`` reads every model file to build its lazy index, and the first model
    class pulls in ``modeling_utils``, generation and the mask functions; galva-hp's tensor-parallel layers import
    megatron-core on first use: seconds of one core each, several times that on a loaded machine. Multi-rank tests
    fork the pytest process, so without this each of their ranks, in each launch, did all of it again: most of a
    table-sweep launch's time (a check of 3 plans: 50 s before, 14 s after). Only what a collected test already
    imported: a torch-free run stays torch-free."""
    import importlib
    import warnings

    warm = {
        # the lazy index, then one family's modeling file: modeling_utils, generation and masks, as every family's
        "transformers": ("transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama"),
        "galva_hp": ("megatron.core.tensor_parallel",),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's "Apex is not installed", by design on CPU
        for trigger, modules in warm.items():
            if trigger in sys.modules:
                for module in modules:
                    importlib.import_module(module)
    if "torch" in sys.modules and "OMP_NUM_THREADS" not in os.environ:
        # one compute thread in this process, as every forked rank has: the tests' tensors are tiny, and a second
        # OpenMP thread only spins on a core that mypy or another process holds (the Hugging Face oracle of one
        # table family: 0.2 CPU-s on one thread, 1.1-7 on two, on the loaded 2-core machine). Commands the tests
        # start keep their own thread count.
        sys.modules["torch"].set_num_threads(1)

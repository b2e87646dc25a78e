"""Every error that names a missing extra gives a command that works where the package came
from: by name from an index, by path from a source checkout (the by-name form alone fails
there: the package is not on an index)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from triattn_cupy import _install, cuda_setup, export, importing
from triattn_cupy.cli import cluster_run
from triattn_cupy.gpu import checks

PACKAGE = Path(__file__).resolve().parents[1] / "triattn_cupy"


def test_pip_install_names_both_commands():
    assert _install.pip_install("distributed") == (
        'pip install "triattn-cupy[distributed]" (from a source checkout: '
        'pip install ".[distributed]")')
    assert _install.pip_install("cuda13", "distributed-cuda") == (
        'pip install "triattn-cupy[cuda13,distributed-cuda]" (from a source checkout: '
        'pip install ".[cuda13,distributed-cuda]")')


def _missing(module):
    """Makes `import module` fail."""
    return lambda monkeypatch: monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.parametrize("make_missing, call, extra", [
    (_missing("cupy"), cuda_setup.require_cuda, "cuda13"),
    (_missing("cupy"), checks._cupy, "cuda13"),
    (_missing("torch"), export._import_torch, "export"),
    (_missing("torch"), importing._import_torch, "export"),
    (_missing("safetensors"), lambda: importing._load_safetensors("w.safetensors"),
     "safetensors"),
    (lambda monkeypatch: monkeypatch.setattr(cluster_run, "_IMPORT_ERROR",
                                             ImportError("No module named 'distributed'")),
     cluster_run.require_dask, "distributed"),
], ids=["cuda_setup", "gpu.checks", "export", "importing", "safetensors", "distributed"])
def test_missing_extra_names_a_working_command(monkeypatch, make_missing, call, extra):
    make_missing(monkeypatch)
    monkeypatch.setattr(cuda_setup, "_ready", False)
    with pytest.raises(ImportError, match=re.escape(_install.pip_install(extra))):
        call()


def test_no_hint_names_the_index_form_alone():
    """The old hints' spellings (`pip install triattn-cupy[x]`, `pip install
    'triattn-cupy[x]'`, `install triattn-cupy[x]`) appear nowhere in the package."""
    old = re.compile(r"(pip )?install ['\"]?triattn-cupy\[")
    found = [f"{path.relative_to(PACKAGE)}:{text[:m.start()].count(chr(10)) + 1}"
             for path in sorted(PACKAGE.rglob("*.py")) if path.name != "_install.py"
             for text in [path.read_text()] for m in old.finditer(text)
             if ".[" not in text[m.start():m.start() + 200]]
    assert not found, found


def test_gpu_probe_without_cupy_names_a_working_command(monkeypatch):
    from triattn_cupy.cli import backends

    monkeypatch.setitem(sys.modules, "cupy", None)
    count, why = backends.gpu_probe()
    assert count == 0 and _install.pip_install("cuda13") in why, why

"""The PyTorch statement of the spec that the tests use, and where the reference file lives.

`load_spec_module()` returns `torch_spec` (this folder's own PyTorch module); it skips the
calling test only where torch is not installed. The reference module file that `torch_spec`
is checked against (`tests/test_torch_spec.py`) and that the benchmark's PyTorch systems
are built from is looked for at ``../shared/spec/`` beside the repository, then at
``.shared/spec/`` inside it: `find_spec_file()`.
"""
from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
CANDIDATES = (REPO.parent / "shared" / "spec" / "reference_module.py",
              REPO / ".shared" / "spec" / "reference_module.py")
_REFERENCE_MODULE_NAME = "triattn_spec_reference_module"


def find_spec_file():
    """The first existing reference_module.py of `CANDIDATES`, or None."""
    return next((path for path in CANDIDATES if path.is_file()), None)


def load_spec_module():
    """`torch_spec`, our PyTorch statement of the spec; skips the calling test without torch."""
    pytest.importorskip("torch", reason="the PyTorch spec module needs torch")
    return importlib.import_module("torch_spec")


def load_reference_file_module():
    """The module in the reference_module.py file that `find_spec_file()` finds (cached);
    skips the calling test, naming the paths looked at, where there is none."""
    pytest.importorskip("torch", reason="the reference module needs torch")
    if _REFERENCE_MODULE_NAME in sys.modules:
        return sys.modules[_REFERENCE_MODULE_NAME]
    path = find_spec_file()
    if path is None:
        pytest.skip("reference_module.py not found; looked at "
                    + " and ".join(str(p) for p in CANDIDATES))
    spec = importlib.util.spec_from_file_location(_REFERENCE_MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_REFERENCE_MODULE_NAME] = module
    return module

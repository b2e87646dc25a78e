"""Find and import the spec (``reference_module.py``, the PyTorch reference module).

Looked for at ``../shared/spec/`` beside the repository, then at ``.shared/spec/`` inside
it. A test that needs it calls `load_spec_module()`, which skips the test with a reason
when torch or the file is missing.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
CANDIDATES = (REPO.parent / "shared" / "spec" / "reference_module.py",
              REPO / ".shared" / "spec" / "reference_module.py")
_MODULE_NAME = "triattn_spec_reference_module"


def find_spec_file():
    """The first existing candidate path, or None."""
    return next((path for path in CANDIDATES if path.is_file()), None)


def load_spec_module():
    """The imported spec module (cached); skips the calling test if it is unavailable."""
    pytest.importorskip("torch", reason="the spec module needs torch")
    if _MODULE_NAME in sys.modules:
        return sys.modules[_MODULE_NAME]
    path = find_spec_file()
    if path is None:
        pytest.skip("spec reference_module.py not found; looked at "
                    + " and ".join(str(p) for p in CANDIDATES))
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_MODULE_NAME] = module
    return module

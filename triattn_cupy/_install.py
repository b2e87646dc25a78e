"""The install command an error message names for an optional part of the package.

An extra installs by the package's name only once the package is on an index; from a
source checkout it installs by path. A hint names both, so that the command it gives works
wherever the package came from.
"""
from __future__ import annotations


def pip_install(*extras: str) -> str:
    """``pip install "triattn-cupy[a,b]"`` and its source-checkout form, for `extras`."""
    names = ",".join(extras)
    return (f'pip install "triattn-cupy[{names}]" (from a source checkout: '
            f'pip install ".[{names}]")')

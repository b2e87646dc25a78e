"""Fixtures and helpers of the `triattn-infer` tests (test_cli*.py): tiny weights (D=16,
h=2) saved to a file, a folder of inputs in every format, and the library call an output
must equal."""
from __future__ import annotations

import hashlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from triattn_cupy import random_weights, reference
from triattn_cupy.cli import main as cli_main
from triattn_cupy.hdf5 import save_weights

REPO = pathlib.Path(__file__).resolve().parent.parent
D, H = 16, 2


def child_env():
    """The environment for a child Python that imports this checkout and tests/."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def weights():
    return random_weights(D, H, seed=7)


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory, weights):
    path = tmp_path_factory.mktemp("weights") / "w16.h5"
    save_weights(weights, path)
    return path


def make_pair(rng, *shape, dtype=np.float32):
    return (rng.standard_normal(shape + (D,)) * 1.5 + 0.25).astype(dtype)


def padding_mask(B, N, valid, dtype=bool):
    """Keys and queries >= valid padded: queries valid.. have every key masked."""
    keep = np.arange(N) < valid
    m = (keep[:, None] & keep[None, :]).astype(dtype)
    return np.broadcast_to(m, (B, N, N)).copy() if B else m


def cli(weights_file, out_dir, *args, device="cpu"):
    argv = [*map(str, args), "--output-dir", str(out_dir), "--weights", str(weights_file)]
    if device:
        argv += ["--device", device]
    return cli_main.main(argv)


def read_output(path):
    path = pathlib.Path(path)
    if path.suffix == ".npy":
        return np.load(path), {}
    with h5py.File(path, "r") as f:
        return f["out"][()], dict(f.attrs)


def expected_output(weights, pair, mask=None, fully_masked="zero"):
    """The library call the CLI must reproduce: the NumPy backend in float32."""
    return reference.triangle_attention(np.asarray(pair).astype(np.float32), mask, weights,
                                        fully_masked=fully_masked, dtype=np.float32)


def assert_same(actual, expected):
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6)


def sha(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def all_files(folder):
    return sorted(str(p.relative_to(folder)) for p in pathlib.Path(folder).rglob("*")
                  if p.is_file())


def write_h5(path, **datasets):
    with h5py.File(path, "w") as f:
        for name, value in datasets.items():
            f[name] = value


@pytest.fixture
def dataset(tmp_path):
    """A folder with every input format, batched and not, masked and not, float32 and
    float64, N from 4 to 11, one level of sub-folder. Returns (folder, {rel: (pair, mask)})."""
    rng = np.random.default_rng(1)
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    items = {
        "a.npy": (make_pair(rng, 7, 7), None),
        "b.npy": (make_pair(rng, 2, 5, 5, dtype=np.float64), None),
        "c.npz": (make_pair(rng, 9, 9), padding_mask(0, 9, 7)),
        "d.npz": (make_pair(rng, 3, 4, 4, dtype=np.float64), None),
        "sub/e.h5": (make_pair(rng, 11, 11, dtype=np.float64),
                     (rng.random((11, 11)) > 0.3).astype(np.int32)),
        "sub/f.hdf5": (make_pair(rng, 2, 6, 6),
                       padding_mask(2, 6, 4, dtype=np.float32) * 2.0),
    }
    for rel, (pair, mask) in items.items():
        path = src / rel
        if path.suffix == ".npy":
            np.save(path, pair)
        elif path.suffix == ".npz":
            np.savez(path, **({"pair": pair} | ({} if mask is None else {"mask": mask})))
        else:
            write_h5(path, pair=pair, **({} if mask is None else {"mask": mask}))
    return src, items


SLOW_RUN = """
import sys, time
from triattn_cupy.cli import main, outputs
real = outputs._write_hdf5
def slow(tmp, out, attrs):
    real(tmp, out, attrs)
    time.sleep({sleep})  # the temporary file exists, complete but not yet renamed
outputs._write_hdf5 = slow
sys.exit(main.main({argv!r}))
"""


def start_slow_run(src, out, weights_file, *, sleep: float, extra=()):
    """A `triattn-infer` child process (CPU backend) that holds each finished output as a
    temporary file for `sleep` seconds before renaming it."""
    argv = [str(src), "-o", str(out), "--weights", str(weights_file), "--device", "cpu",
            *map(str, extra)]
    # A shell without job control starts background jobs with SIGINT ignored, and Python
    # then installs no KeyboardInterrupt handler: give the child the default disposition a
    # user's terminal would, whatever this test process inherited.
    return subprocess.Popen([sys.executable, "-c", SLOW_RUN.format(sleep=sleep, argv=argv)],
                            env=child_env(), stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_temp(out, proc, timeout: float = 60):
    """Wait until a temporary output exists under `out` (the child is mid-write); the
    temporary files claims are written through do not count."""
    out = pathlib.Path(out)
    deadline = time.time() + timeout
    while time.time() < deadline and not (out.exists() and any(
            p.name.endswith(".tmp") and ".claim." not in p.name for p in out.iterdir())):
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1]

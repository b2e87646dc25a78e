"""Fuzz suite: generated weight files, inputs (.npy, .npz, .h5) and masks against the
weights loader, the `triattn-infer` readers, the NumPy backend and the batch CLI.

Each case runs in a child process (tests/fuzz_worker.py) under a memory limit
(RLIMIT_AS, `MEMORY_LIMIT`) and a time limit (`CASE_SECONDS`; a case past it is a hang:
the child is killed and restarted). A case passes when the function under test either
works (valid input) or refuses with its documented error (WeightsFormatError,
InputError) carrying a message; a crash (any other exception, a MemoryError included), a
hang, a valid input refused, a bad input accepted, a non-finite or wrong backend output,
or an output lost by the CLI fails it. Hypothesis draws the cases (no example database,
so CI runs are independent); the whole file takes about a minute on 2 cores.

Kinds of input tried: 60 kinds of bad input (27 for weights files, 33 for inputs) and 9
of valid input; the suite prints, with -s, how many cases of each kind (per file format)
ran and how each ended.

- weights files (`triattn_cupy.hdf5.load_weights`), valid: plain, float64 / big-endian
  / float16 datasets, a hard-linked dataset, a soft link inside the file. Bad (27):
  wrong or missing `format`, wrong `format_version`, `pair_dim` / `num_heads` of any
  integer up to 10**12 or of the wrong type, `layer_norm_eps` not a positive finite
  number, a missing dataset, a wrong shape, a wrong dtype (int, complex, bool, bytes),
  NaN / Inf, float64 beyond float32, a group where a dataset belongs, an unexpected
  dataset, an empty dataspace, shapes of up to pair_dim 4096 with no data stored,
  external raw storage, a virtual dataset, an external link, flipped bytes, a truncated
  file, random bytes, a FIFO; chunks of 2 or 16 MiB on a small dataset (a chunk bomb), a
  filter no library registers (HDF5 would look for a plugin), groups nested 33 to 1000
  deep, a chunked and filtered dataset with a chunk unwritten, a named datatype in place
  of a dataset (what a damaged header can make of it);
- inputs (`triattn_cupy.cli.io.read_input`), valid: .npy of format 1.0 / 2.0 / 3.0 in
  C or Fortran order, .npz and .h5 with and without masks (bool, int8, float32), float32
  and float64, batched or not. Bad (33): a wrong D, non-square, 1 / 2 / 5 axes, N = 0,
  dtypes int / complex / float16 / bool / bytes, NaN / Inf, float64 beyond float32, a
  mask of the wrong shape or dtype or with NaN, a required mask missing, a header that
  declares 8e10 elements the file does not hold, flipped bytes, truncation, random
  bytes, an empty file, a FIFO, a device (a link to /dev/zero); for .npy a file cut short
  once its header is checked (it shrinks during the read); for .npz a missing key, an
  archive entry whose size contradicts its header, and 70 MB of zeros deflated ~1000
  times (a bomb); for .h5 external storage, a virtual dataset, an external link,
  unwritten data, a group at the key, an empty dataspace, a gzip mask of the wrong shape
  that decompresses to 64 MB, and the weights' chunk bomb, unknown filter, unwritten
  chunk and deep nesting;
- the NumPy backend: random shapes, batches, masks with fully-masked rows, magnitudes
  from 1e-3 to 1e30, positions constant across D (7.3 to 3e38), float32 against float64
  (relative L2 error < 1e-4, finite);
- the batch CLI on folders that mix valid and bad inputs: exit status 1 when a file is
  bad, else 0; an output for every valid input, none for a bad one, no temporary file or
  claim left behind;
- the batch CLI after runs that ended badly (`LEFTOVERS`, 9 kinds): claims naming this
  process's id from another run or an older version (a restart that reused the id), PID 1
  of another program, a process that has ended, temporary files of a reused process id
  (all taken over), a folder at a claim's name and another host's claim dated in the
  future (conflicts: exit 1, left as they are), a live process's claim (respected).
"""
from __future__ import annotations

import collections
import json
import os
import select
import subprocess
import sys
import time
import zipfile

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triattn_cupy import random_weights, save_weights
from triattn_cupy.weights import parameter_shapes
from cli_support import REPO, child_env

MEMORY_LIMIT = 3 << 30  # address space of the worker: a read of a declared size fails it
CASE_SECONDS = 30.0
SETTINGS = settings(max_examples=60, deadline=None, database=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])
TALLY = collections.defaultdict(collections.Counter)  # kind -> outcome counts


class Worker:
    """The child process running cases; restarted after a hang or a death."""

    def __init__(self):
        self.proc = None

    def start(self):
        env = child_env()
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   MALLOC_ARENA_MAX="2")
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "fuzz_worker.py"), str(MEMORY_LIMIT)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=env)

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def run(self, request: dict) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], CASE_SECONDS)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            died = self.proc.poll() is not None
            self.stop()
            return {"status": "died" if died else "hang", "type": "", "message": ""}
        return json.loads(line)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.stop()
    lines = [f"{kind:<34} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
             for kind, c in sorted(TALLY.items())]
    bad = sum(1 for kind in TALLY if not kind.startswith(("valid", "reference", "cli")))
    print(f"\nfuzz: {len(TALLY)} kinds tried ({bad} of bad input)\n" + "\n".join(lines))


def check(worker, kind: str, request: dict, expect: str):
    """Run one case; `expect`: "ok", "refused", or "any" (either, never a crash/hang)."""
    answer = worker.run(request)
    status = answer["status"]
    TALLY[kind][status] += 1
    if status == "crash":  # the worker's state may be damaged: the next case gets a new one
        worker.stop()
    assert status in ("ok", "refused"), (kind, answer)
    if status == "refused":
        assert answer["message"].strip(), (kind, answer)
    if expect != "any":
        assert status == expect, (kind, expect, answer)
    return answer


# --- weights files ------------------------------------------------------------------------

def _replace(f, name, **kwargs):
    del f[name]
    return f.create_dataset(name, **kwargs)


def _weights_mutation(draw, f, path, D, h, tmp):
    """Apply one drawn change to the open weights file `f`; return (kind, expected)."""
    names = [n.replace(".", "/") for n in parameter_shapes(D, h)]
    name = draw(st.sampled_from(names))
    kind = draw(st.sampled_from([
        "valid", "valid_float_types", "valid_hard_link", "valid_soft_link", "format",
        "format_version", "pair_dim", "num_heads", "head_dim", "attr_type", "eps",
        "missing_dataset",
        "wrong_shape", "wrong_dtype", "non_finite", "overflow", "group", "extra_dataset",
        "empty_dataspace", "unwritten", "external_storage", "virtual", "external_link",
        "chunk_bomb", "unknown_filter", "nesting", "unwritten_chunks", "damaged_object"]))
    shape = f[name].shape
    if kind == "valid_float_types":
        dtype = draw(st.sampled_from(["<f8", ">f4", "<f2"]))
        _replace(f, name, data=np.zeros(shape, dtype))
    elif kind == "valid_hard_link":
        del f["key/bias"]
        f["key/bias"] = f["query/bias"]
    elif kind == "valid_soft_link":
        del f["gate/bias"]
        f["gate/bias"] = h5py.SoftLink("/query/bias")
    elif kind == "format":
        value = draw(st.one_of(st.none(), st.text(st.characters(blacklist_characters="\0"),
                                                  max_size=30),
                               st.binary(max_size=30).filter(lambda b: b"\0" not in b)))
        if value is None:
            del f.attrs["format"]
        else:
            f.attrs["format"] = value
            if value in ("triattn-cupy/weights", b"triattn-cupy/weights"):
                kind = "valid"
    elif kind == "format_version":
        f.attrs["format_version"] = draw(st.integers(-2**40, 2**40).filter(lambda v: v != 1))
    elif kind in ("pair_dim", "num_heads", "head_dim"):
        value = draw(st.integers(-10, 10**12))
        f.attrs[kind] = value
        if value == {"pair_dim": D, "num_heads": h, "head_dim": D // h}[kind]:
            kind = "valid"
    elif kind == "attr_type":
        attr = draw(st.sampled_from(["pair_dim", "num_heads", "head_dim"]))
        f.attrs[attr] = draw(st.sampled_from(
            [1.5, "16", np.arange(2), True, b"\xff"]))
    elif kind == "eps":
        f.attrs["layer_norm_eps"] = draw(st.sampled_from(
            [0.0, -1e-5, float("nan"), float("inf"), "1e-5", np.ones(2)]))
    elif kind == "missing_dataset":
        name = draw(st.sampled_from([n for n in names if not n.endswith("bias")
                                     or n.startswith(("layer_norm", "bias_proj"))]))
        del f[name]
    elif kind == "wrong_shape":
        new = draw(st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
                   .filter(lambda s: s != shape))
        _replace(f, name, data=np.zeros(new, np.float32))
    elif kind == "wrong_dtype":
        dtype = draw(st.sampled_from(["<i4", "<c8", "?", "S4"]))
        _replace(f, name, data=np.zeros(shape, dtype))
    elif kind == "non_finite":
        data = f[name][()]
        data.flat[draw(st.integers(0, data.size - 1))] = draw(
            st.sampled_from([np.nan, np.inf, -np.inf]))
        f[name][...] = data
    elif kind == "overflow":
        data = f[name][()].astype(np.float64)
        data.flat[0] = 1e300
        _replace(f, name, data=data)
    elif kind == "group":
        del f[name]
        f.create_group(name)
    elif kind == "extra_dataset":
        f[draw(st.sampled_from(["extra", "query/extra", "x/y/z"]))] = np.zeros(3)
    elif kind == "empty_dataspace":
        _replace(f, name, data=h5py.Empty("f4"))
    elif kind == "unwritten":
        big = draw(st.sampled_from([256, 1024, 4096]))
        f.attrs["pair_dim"], f.attrs["num_heads"], f.attrs["head_dim"] = big, 4, big // 4
        for n, s in parameter_shapes(big, 4).items():
            if n.replace(".", "/") in f:
                del f[n.replace(".", "/")]
            f.create_dataset(n.replace(".", "/"), shape=s, dtype=np.float32)
    elif kind == "external_storage":
        raw = os.path.join(tmp, "raw.bin")
        with open(raw, "wb") as r:
            r.write(b"\0" * (4 * int(np.prod(shape))))
        _replace(f, name, shape=shape, dtype=np.float32,
                 external=[(raw, 0, 4 * int(np.prod(shape)))])
    elif kind == "virtual":
        layout = h5py.VirtualLayout(shape=shape, dtype=np.float32)
        layout[...] = h5py.VirtualSource(os.path.join(tmp, "gone.h5"), "x", shape=shape)
        del f[name]
        f.create_virtual_dataset(name, layout, fillvalue=0)
    elif kind == "external_link":
        other = os.path.join(tmp, "other.h5")
        with h5py.File(other, "w") as o:
            o["x"] = f[name][()]
        del f[name]
        f[name] = h5py.ExternalLink(other, "/x")
    elif kind in ("chunk_bomb", "unknown_filter", "unwritten_chunks"):
        _replace_stored(draw, f, name, kind)
    elif kind == "nesting":
        f.create_group("/".join(["g"] * draw(st.integers(33, 1000))))
    elif kind == "damaged_object":  # what a flipped header byte can make of a dataset
        del f[name]
        f[name] = np.dtype("<f4")
    return kind, ("ok" if kind.startswith("valid") else "refused")


def _replace_stored(draw, f, name, kind):
    """Replace dataset `name` of `f` (its values kept) by one stored in a hostile way:
    chunks far larger than its data, a filter nobody registers (LZF's id changed by
    `unknown_filters` once the file is closed), or chunked + filtered with chunks
    unwritten."""
    data = f[name][()]
    del f[name]
    filters = draw(st.sampled_from([{"compression": "gzip"}, {"shuffle": True}, {}]))
    if kind == "chunk_bomb":
        row_bytes = data[:1].nbytes  # chunks of 2 or 16 MiB: past 1 MiB and the data
        rows = draw(st.sampled_from([2 << 20, 16 << 20])) // row_bytes
        chunks = (rows,) + data.shape[1:]
        f.create_dataset(name, data=data, chunks=chunks, maxshape=(None,) * data.ndim,
                         **filters)
    elif kind == "unknown_filter":
        f.create_dataset(name, data=np.zeros_like(data), compression="lzf")
    else:
        half = -(-data.shape[-1] // 2)  # at least two chunks, one of them written
        ds = f.create_dataset(name, shape=data.shape, dtype=data.dtype,
                              chunks=(1,) * (data.ndim - 1) + (half,),
                              **(filters or {"compression": "gzip"}))
        first = (0,) * (data.ndim - 1) + (slice(0, half),)
        ds[first] = data[first]


def unknown_filters(path):
    """Rename every LZF filter (32000) of the file at `path` to 32001, mandatory: a filter
    that no library registers, so HDF5 looks for a plugin."""
    raw = bytearray(open(path, "rb").read())
    at = raw.find(b"lzf\0")
    while at >= 0:
        entry = at - 8  # the pipeline message's entry: id, name length, flags, ...
        if raw[entry:entry + 2] == (32000).to_bytes(2, "little"):
            raw[entry:entry + 2] = (32001).to_bytes(2, "little")
            raw[entry + 4:entry + 6] = b"\0\0"
        at = raw.find(b"lzf\0", at + 1)
    open(path, "wb").write(raw)


@settings(SETTINGS, max_examples=250)
@given(data=st.data())
def test_weights_files(worker, tmp_path_factory, data):
    tmp = str(tmp_path_factory.mktemp("w"))
    path = os.path.join(tmp, "w.h5")
    D, h = data.draw(st.sampled_from([(4, 1), (8, 2), (12, 3), (16, 4)]))
    save_weights(random_weights(D, h, seed=data.draw(st.integers(0, 99))), path)
    damage = data.draw(st.sampled_from(["none", "none", "none", "flip", "truncate",
                                        "random", "fifo"]))
    if damage == "none":
        with h5py.File(path, "r+") as f:
            kind, expect = _weights_mutation(data.draw, f, path, D, h, tmp)
        if kind == "unknown_filter":
            unknown_filters(path)
    else:
        kind, expect = f"bytes_{damage}", "refused"
        raw = bytearray(open(path, "rb").read())
        if damage == "flip":
            for i in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1,
                                        max_size=20)):
                raw[i] ^= data.draw(st.integers(1, 255))
            expect = "any"
        elif damage == "truncate":
            raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
            expect = "any"  # the cut may fall in unused space at the end
        elif damage == "random":
            raw = bytearray(data.draw(st.binary(max_size=2000)))
        os.remove(path)
        if damage == "fifo":
            os.mkfifo(path)
        else:
            open(path, "wb").write(raw)
    check(worker, f"weights:{kind}", {"op": "load_weights", "path": path}, expect)


# --- inputs -------------------------------------------------------------------------------

D_IN = 8  # pair_dim of the inputs' weights


@st.composite
def pairs(draw):
    """(pair, mask or None, batched) of a valid input."""
    B = draw(st.sampled_from([0, 1, 2]))
    N = draw(st.integers(1, 6))
    shape = ((B,) if B else ()) + (N, N, D_IN)
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    pair = np.random.default_rng(draw(st.integers(0, 2**32))).standard_normal(shape)
    pair = pair.astype(dtype)
    if draw(st.booleans()):
        pair = np.asfortranarray(pair)
    mask = None
    if draw(st.booleans()):
        mask = draw(st.lists(st.booleans(), min_size=(B or 1) * N * N,
                             max_size=(B or 1) * N * N))
        mask = np.array(mask).reshape(shape[:-1]).astype(
            draw(st.sampled_from([bool, np.int8, np.float32])))
    return pair, mask


def _npy_bytes(arr, version):
    """`arr` as a .npy of format `version` (3.0 written by hand: NumPy writes it only for
    dtypes with UTF-8 field names)."""
    header = repr({"descr": np.lib.format.dtype_to_descr(arr.dtype),
                   "fortran_order": False, "shape": arr.shape})
    size = 8 + (2 if version == 1 else 4)
    header += " " * (63 - (size + len(header)) % 64) + "\n"
    length = len(header).to_bytes(2 if version == 1 else 4, "little")
    return (b"\x93NUMPY" + bytes([version, 0]) + length + header.encode()
            + np.ascontiguousarray(arr).tobytes())


def _write_input(draw, path, fmt, pair, mask, tmp):
    """Write one input of format `fmt` with one drawn defect; (kind, expected, required)."""
    kinds = ["valid", "valid", "wrong_d", "non_square", "axes", "zero_n", "dtype",
             "non_finite", "overflow", "mask_shape", "mask_dtype", "mask_nan",
             "mask_required", "declared_huge"]
    kinds += {"npy": ["shrinking"], "npz": ["missing_key", "size_lie", "bomb"],
              "h5": ["external_storage", "virtual", "external_link", "unwritten", "group",
                     "empty_dataspace", "compressed_mask", "chunk_bomb", "unknown_filter",
                     "nesting", "unwritten_chunks"]}[fmt]
    kind = draw(st.sampled_from(kinds))
    if fmt == "npy" and kind.startswith("mask"):
        kind = "mask_required"  # a .npy holds no mask
    required = kind == "mask_required"
    if required:
        mask = None
    elif kind == "wrong_d":
        pair = np.zeros(pair.shape[:-1] + (draw(st.integers(1, 20).filter(
            lambda d: d != D_IN)),), np.float32)
    elif kind == "non_square":
        pair = np.zeros(pair.shape[:-3] + (2, 3, D_IN), np.float32)
        mask = None
    elif kind == "axes":
        pair = np.zeros(draw(st.sampled_from([(D_IN,), (3, D_IN), (1, 1, 2, 2, D_IN)])),
                        np.float32)
        mask = None
    elif kind == "zero_n":
        pair, mask = np.zeros((0, 0, D_IN), np.float32), None
    elif kind == "dtype":
        # (float16 pairs are valid inputs: they give float16 outputs)
        pair = np.zeros(pair.shape, draw(st.sampled_from(["<i4", "<c8", "<u2", "?",
                                                          "S2"])))
    elif kind == "non_finite":
        pair = pair.copy()
        pair.flat[draw(st.integers(0, pair.size - 1))] = draw(
            st.sampled_from([np.nan, np.inf, -np.inf]))
    elif kind == "overflow":
        pair = pair.astype(np.float64)
        pair.flat[0] = 1e300
    elif kind == "mask_shape":
        mask = np.ones(draw(st.sampled_from([(1,), (2, 3), (7, 7), (3, 1, 1, 1)])), bool)
    elif kind == "mask_dtype":
        mask = np.zeros(pair.shape[:-1], draw(st.sampled_from(["<c8", "S1"])))
    elif kind == "mask_nan":
        mask = np.ones(pair.shape[:-1], np.float32)
        mask.flat[0] = np.nan
    expect = "ok" if kind == "valid" else "refused"
    if kind == "shrinking":  # valid as written; the worker shrinks it during the read.
        # Larger than the reader's buffer, which the header's read fills with the data
        # of a small file (read whole then: a consistent snapshot).
        pair = np.ones((40, 40, D_IN), pair.dtype) * pair.flat[0]
    if fmt == "npy":
        if kind == "declared_huge":
            data = _npy_bytes(np.zeros((1, 1, D_IN), np.float32), 1)
            data = data.replace(b"(1, 1, 8)", b"(100000, 100000, 8)")
        elif pair.dtype.kind == "S":
            data = _npy_bytes(pair, 1)
        else:
            version = draw(st.sampled_from([1, 2, 3, None])) if kind == "valid" else None
            data = None if version is None else _npy_bytes(pair, version)  # None: np.save
        if data is None:
            np.save(path, pair)
        else:
            open(path, "wb").write(data)
    elif fmt == "npz":
        arrays = {"pair": pair} if kind != "missing_key" else {"other": pair}
        if mask is not None:
            arrays["mask"] = mask
        if kind == "declared_huge":
            arrays["pair"] = np.zeros((1, 1, D_IN), np.float32)
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            for key, arr in arrays.items():
                data = _npy_bytes(arr, 1) if arr.dtype.kind == "S" or kind == "declared_huge" \
                    else None
                if kind == "declared_huge" and key == "pair":
                    data = data.replace(b"(1, 1, 8)", b"(100000, 100000, 8)")
                if data is None:
                    with z.open(f"{key}.npy", "w") as m:
                        np.lib.format.write_array(m, arr, allow_pickle=False)
                else:
                    z.writestr(f"{key}.npy", data)
        if kind == "bomb":  # 70 MB of zeros, deflated ~1000 times
            with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
                with z.open("pair.npy", "w", force_zip64=True) as m:
                    np.lib.format.write_array_header_1_0(m, {
                        "descr": "<f4", "fortran_order": False, "shape": (1, 2100, 1050, 8)})
                    for _ in range(2100 * 1050 * 8 * 4 >> 20):
                        m.write(bytes(1 << 20))
                    m.write(bytes(2100 * 1050 * 8 * 4 % (1 << 20)))
        if kind == "size_lie":  # the header announces 50 times the data stored
            with zipfile.ZipFile(path, "w") as z:
                data = _npy_bytes(np.ascontiguousarray(pair), 1)
                z.writestr("pair.npy", data.replace(b"'shape': (", b"'shape': (50, ", 1))
    else:
        with h5py.File(path, "w") as f:
            key = "pair"
            if kind == "external_storage":
                raw = os.path.join(tmp, "raw.bin")
                open(raw, "wb").write(pair.astype(np.float32).tobytes())
                f.create_dataset(key, shape=pair.shape, dtype=np.float32,
                                 external=[(raw, 0, pair.astype(np.float32).nbytes)])
            elif kind == "virtual":
                layout = h5py.VirtualLayout(shape=pair.shape, dtype=np.float32)
                layout[...] = h5py.VirtualSource(os.path.join(tmp, "gone.h5"), "x",
                                                 shape=pair.shape)
                f.create_virtual_dataset(key, layout, fillvalue=0)
            elif kind == "external_link":
                other = os.path.join(tmp, "other.h5")
                with h5py.File(other, "w") as o:
                    o["x"] = pair
                f[key] = h5py.ExternalLink(other, "/x")
            elif kind in ("unwritten", "declared_huge"):
                f.create_dataset(key, shape=(20000, 20000, D_IN), dtype=np.float32)
            elif kind == "group":
                f.create_group(key)
            elif kind == "empty_dataspace":
                f.create_dataset(key, data=h5py.Empty("f4"))
            elif kind in ("chunk_bomb", "unknown_filter", "unwritten_chunks"):
                f[key] = pair
                _replace_stored(draw, f, key, kind)
            elif kind == "nesting":  # no pair: the error lists what the file holds
                f.create_group("/".join(["g"] * draw(st.integers(33, 1000))))
            elif pair.dtype.kind == "S":
                f[key] = pair.astype("S2")
            else:
                f[key] = pair
            if kind == "nesting":
                mask = None
            if kind == "compressed_mask":
                f.create_dataset("mask", data=np.zeros((8000, 8000), bool),
                                 chunks=(1000, 1000), compression="gzip")
            elif mask is not None:
                f["mask"] = mask
    if kind == "unknown_filter":
        unknown_filters(path)
    return kind, expect, required


@settings(SETTINGS, max_examples=400)
@given(data=st.data(), fmt=st.sampled_from(["npy", "npz", "h5"]))
def test_inputs(worker, tmp_path_factory, data, fmt):
    tmp = str(tmp_path_factory.mktemp("in"))
    path = os.path.join(tmp, f"x.{fmt}")
    pair, mask = data.draw(pairs())
    damage = data.draw(st.sampled_from(["none"] * 6 + ["flip", "truncate", "random", "empty",
                                                       "fifo", "device"]))
    kind, expect, required = _write_input(data.draw, path, fmt, pair, mask, tmp)
    if damage != "none":
        kind, expect = f"bytes_{damage}", "any"
        raw = bytearray(open(path, "rb").read())
        if damage == "flip":
            for i in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1,
                                        max_size=10)):
                raw[i] ^= data.draw(st.integers(1, 255))
        elif damage == "truncate":
            raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
            expect = "refused"
        elif damage in ("random", "empty"):
            raw = bytearray(data.draw(st.binary(max_size=3000)) if damage == "random" else b"")
            expect = "refused"
        os.remove(path)
        if damage == "fifo":
            os.mkfifo(path)
            expect = "refused"
        elif damage == "device":
            os.symlink("/dev/zero", path)
            expect = "refused"
        else:
            open(path, "wb").write(raw)
    kindname = {"npy": "npy", "npz": "npz", "h5": "hdf5"}[fmt]
    request = {"op": "read_input", "path": path, "kind": kindname, "pair_dim": D_IN,
               "mask_required": required}
    if kind == "shrinking":  # cut once the header is checked, before the data are read
        request["shrink_to"] = data.draw(st.integers(0, os.path.getsize(path) - 1))
    check(worker, f"{'input' if kind != 'valid' else 'valid input'}:{fmt}:{kind}", request,
          expect)


# --- the NumPy backend --------------------------------------------------------------------

@settings(SETTINGS, max_examples=40)
@given(data=st.data())
def test_reference_backend(worker, tmp_path_factory, data):
    D, h = data.draw(st.sampled_from([(8, 2), (12, 3), (16, 4)]))
    B, N = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 9))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32)))
    scale = 10.0 ** data.draw(st.integers(-3, 30))
    pair = (rng.standard_normal((B, N, N, D)) * scale).astype(np.float32)
    if data.draw(st.booleans()):  # positions constant across D (LayerNorm gives beta)
        constant = rng.random((B, N, N)) < 0.3
        pair[constant] = np.float32(data.draw(st.sampled_from([-3e20, 7.3, 1e12, 3e38])))
    mask = rng.random((B, N, N)) > data.draw(st.sampled_from([0.0, 0.3, 0.9, 1.0]))
    path = str(tmp_path_factory.mktemp("ref") / "x.npz")
    np.savez(path, pair=pair, mask=mask)
    answer = check(worker, "reference", {"op": "reference", "path": path, "pair_dim": D,
                                         "num_heads": h, "seed": 1}, "ok")
    result = answer["result"]
    assert result["finite"], (scale, result)
    assert result["rel_err"] < 1e-4, (scale, result)


# --- the batch CLI ------------------------------------------------------------------------

@settings(SETTINGS, max_examples=15)
@given(data=st.data())
def test_cli_runs_lose_nothing(worker, tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("cli")
    src, out = tmp / "in", tmp / "out"
    src.mkdir()
    weights = tmp / "w.h5"
    save_weights(random_weights(D_IN, 2, seed=3), weights)
    valid, bad = [], []
    for i in range(data.draw(st.integers(1, 5))):
        fmt = data.draw(st.sampled_from(["npy", "npz", "h5"]))
        pair, mask = data.draw(pairs())
        kind, expect, required = _write_input(data.draw, str(src / f"f{i}.{fmt}"), fmt,
                                              pair, mask, str(tmp))
        # A required mask is dropped from the file: without --mask-key it is valid; so is
        # a file that only the read_input cases shrink.
        (valid if expect == "ok" or required or kind == "shrinking" else bad).append(f"f{i}")
    answer = check(worker, "cli", {"op": "cli", "argv": [
        str(src), "-o", str(out), "--weights", str(weights), "--device", "cpu", "-q"]}, "ok")
    assert answer["result"]["exit"] == (1 if bad else 0), (valid, bad, answer)
    written = sorted(os.listdir(out)) if out.exists() else []
    assert written == sorted(f"{name}.h5" for name in valid), (valid, bad, written)


# Leftovers of runs that ended badly, planted at an output before a run: what the run must
# do with each ("computed": taken over; "conflict": reported, exit 1, left as it is;
# "skipped": a live run's claim, respected).
LEFTOVERS = {
    "none": "computed",
    "claim of this process id, another run": "computed",     # a restart reused the id
    "claim of this process id, older version": "computed",
    "claim of PID 1, another program": "computed",            # PID reused, start differs
    "claim of a process that has ended": "computed",
    "temporary file of a reused process id": "computed",      # removed by the sweep
    "claim that is a folder": "conflict",
    "claim of another host, dated in the future": "conflict",
    "claim of a live process": "skipped",
}


def _plant(kind, out, name, worker_pid):
    """Leave the leftover `kind` at the output `out/name.h5`."""
    from triattn_cupy.cli import runfiles

    claim = out / f".{name}.h5.claim"
    me = runfiles.host_token()

    def record(pid, **fields):
        value = {"host": me, "boot": runfiles.boot_id(), "pid": pid,
                 "pid_start": runfiles.process_start(pid), "run": "earlier run",
                 "started": time.time(), "token": "t", **fields}
        claim.write_text(json.dumps({k: v for k, v in value.items() if v is not ...}))

    if kind == "claim of this process id, another run":
        record(worker_pid)
    elif kind == "claim of this process id, older version":
        record(worker_pid, boot=..., pid_start=..., run=...)
    elif kind == "claim of PID 1, another program":
        record(1, pid_start=(runfiles.process_start(1) or 0) + 1)
    elif kind == "claim of a process that has ended":
        ended = subprocess.Popen([sys.executable, "-c", "pass"])
        ended.wait()
        record(ended.pid, pid_start=12345)
    elif kind == "temporary file of a reused process id":
        start = (runfiles.process_start(worker_pid) or 0) + 1
        (out / f".{name}.h5.{me}-{worker_pid}-s{start}-0123abcd.tmp").write_bytes(b"half")
    elif kind == "claim that is a folder":
        claim.mkdir()
    elif kind == "claim of another host, dated in the future":
        record(7, host="elsewhere")
        later = time.time() + 30 * 24 * 3600
        os.utime(claim, (later, later))
    elif kind == "claim of a live process":
        record(os.getpid())  # this test's process: alive, started when the claim says


@settings(SETTINGS, max_examples=40)
@given(data=st.data())
def test_cli_runs_after_a_restart_lose_nothing(worker, tmp_path_factory, data):
    """Runs that find what earlier runs left (claims naming a reused process id, PID 1 of
    another program, a folder or a future date at a claim's name, temporary files): every
    output is computed, or its file reported (a conflict: exit 1), or left to a live
    claim's run; never skipped for ever with exit 0."""
    tmp = tmp_path_factory.mktemp("restart")
    src, out = tmp / "in", tmp / "out"
    src.mkdir()
    out.mkdir()
    weights = tmp / "w.h5"
    save_weights(random_weights(D_IN, 2, seed=3), weights)
    worker.run({"op": "sleep", "seconds": 0})  # started: its process id is known
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    planted = {}
    for i in range(data.draw(st.integers(1, 4))):
        np.save(src / f"f{i}.npy", rng.standard_normal((4, 4, D_IN)).astype(np.float32))
        planted[f"f{i}"] = data.draw(st.sampled_from(sorted(LEFTOVERS)))
        _plant(planted[f"f{i}"], out, f"f{i}", worker.proc.pid)
    answer = check(worker, "cli after a restart", {"op": "cli", "argv": [
        str(src), "-o", str(out), "--weights", str(weights), "--device", "cpu", "-q"]}, "ok")
    for kind in planted.values():
        TALLY[f"cli leftover: {kind}"]["seen"] += 1
    expect = {name: LEFTOVERS[kind] for name, kind in planted.items()}
    conflict = "conflict" in expect.values()
    assert answer["result"]["exit"] == (1 if conflict else 0), (planted, answer)
    left = sorted(os.listdir(out))
    want = sorted([f"{n}.h5" for n, e in expect.items() if e == "computed"]
                  + [f".{n}.h5.claim" for n, e in expect.items() if e != "computed"])
    assert left == want, (planted, left)


def test_a_hang_is_caught(monkeypatch):
    """The time limit works: a case past it is reported as a hang, the worker is
    killed, and the next case runs in a fresh one."""
    monkeypatch.setattr(sys.modules[__name__], "CASE_SECONDS", 2.0)
    w = Worker()
    try:
        start = time.time()
        assert w.run({"op": "sleep", "seconds": 60})["status"] == "hang"
        assert time.time() - start < 30
        assert w.run({"op": "sleep", "seconds": 0})["status"] == "ok"
    finally:
        w.stop()

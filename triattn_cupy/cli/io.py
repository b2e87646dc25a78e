"""Files of `triattn-infer`: finding inputs, reading and checking them, writing outputs.

Inputs hold a pair representation (N, N, D) or (B, N, N, D), float32 or float64, and
optionally a mask (N, N) / (B, N, N):

    .npy          the pair array alone
    .npz          arrays named by pair_key / mask_key (defaults "pair", "mask")
    .h5 / .hdf5   datasets at pair_key / mask_key (paths such as "group/pair" work)

Every problem with an input raises `InputError` with a sentence that says what is wrong;
the caller adds the path. Inputs are only ever opened read-only.

Outputs are written by `write_output` under a temporary name in their final folder and
renamed into place (`os.replace`, atomic on POSIX and Windows) only when complete and
flushed to disk, so an output file that exists is always complete. HDF5 outputs carry the
root attribute ``format = OUTPUT_FORMAT``, which tells them apart from inputs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import uuid
import zipfile

import numpy as np

from .._checks import check_mask_dtype, check_mask_shape, pair_geometry

INPUT_SUFFIXES = {".npy": "npy", ".npz": "npz", ".h5": "hdf5", ".hdf5": "hdf5"}
OUTPUT_SUFFIXES = {"hdf5": ".h5", "npy": ".npy"}
OUTPUT_FORMAT = "triattn-cupy/infer-output"
OUTPUT_FORMAT_VERSION = 1
OUTPUT_DATASET = "out"
TEMP_SUFFIX = ".tmp"

# Reads, writes and finiteness checks go in slabs of about this many bytes: bounds the
# temporary arrays, and lets h5py's global lock go between slabs, so the reader thread and
# the writer thread take turns instead of one waiting for a whole file.
_SLAB_BYTES = 64 << 20


class InputError(Exception):
    """An input file that cannot be used; the message says why (without the path)."""


@dataclasses.dataclass
class LoadedInput:
    """One input, read and checked. `pair` is float32 and C-contiguous (possibly in pinned
    host memory); `mask` is bool or None; B, N as in `pair_geometry`."""

    pair: np.ndarray
    mask: np.ndarray | None
    B: int
    N: int
    batched: bool
    source_dtype: str
    read_seconds: float = 0.0

    @property
    def positions(self) -> int:
        """Pair positions B*N*N: the unit of throughput."""
        return self.B * self.N * self.N


# --- finding inputs -----------------------------------------------------------------------

def input_kind(path) -> str | None:
    """'npy', 'npz', 'hdf5', or None for a file name with another suffix."""
    return INPUT_SUFFIXES.get(os.path.splitext(os.fspath(path))[1].lower())


def walk_inputs(folder: str, recursive: bool, exclude: str | None = None):
    """Input files under `folder` (sorted; only one level unless `recursive`), as paths.

    `exclude`: a folder whose subtree is skipped (the output folder, when it lies inside
    an input folder, so outputs of an earlier run are not read as inputs).
    """
    found = []
    exclude = os.path.realpath(exclude) if exclude else None
    for root, dirs, files in os.walk(folder):
        if recursive:
            dirs[:] = sorted(d for d in dirs
                             if os.path.realpath(os.path.join(root, d)) != exclude)
        else:
            dirs[:] = []
        for name in sorted(files):
            if input_kind(name) and not name.startswith("."):  # ".x.h5.<id>.tmp" too
                found.append(os.path.join(root, name))
    return found


def output_path(output_dir: str, rel: str, output_format: str) -> str:
    """`output_dir/rel` with the suffix of `output_format` in place of the input's."""
    stem = os.path.splitext(rel)[0]
    return os.path.join(output_dir, stem + OUTPUT_SUFFIXES[output_format])


def is_infer_output(path) -> bool:
    """True for an HDF5 file written by `write_output` (never raises)."""
    if input_kind(path) != "hdf5":
        return False
    try:
        import h5py
        with h5py.File(path, "r") as f:
            return _attr_str(f.attrs.get("format")) == OUTPUT_FORMAT
    except Exception:
        return False


def existing_output_state(path, output_format: str) -> tuple[str, dict]:
    """What lies at an output path: ("missing" | "complete" | "foreign" | "broken", attrs).

    "complete": an output of ours that reads back (its HDF5 attributes are returned);
    "foreign": a readable file that is not ours (an HDF5 file without our format
    attribute), never to be replaced; "broken": unreadable, so not a complete output.
    """
    if not os.path.lexists(path):
        return "missing", {}
    if not os.path.isfile(path):
        return "foreign", {}
    if output_format == "npy":
        try:
            np.load(path, mmap_mode="r", allow_pickle=False)  # header + size check
            return "complete", {}
        except Exception:
            return "broken", {}
    import h5py
    try:
        with h5py.File(path, "r") as f:
            if _attr_str(f.attrs.get("format")) != OUTPUT_FORMAT:
                return "foreign", {}
            if not isinstance(f.get(OUTPUT_DATASET), h5py.Dataset):
                return "broken", {}
            return "complete", {k: _attr_str(v) if isinstance(v, (bytes, str)) else v
                                for k, v in f.attrs.items()}
    except Exception:
        return "broken", {}


# --- reading ------------------------------------------------------------------------------

def read_input(path: str, kind: str, *, pair_dim: int, pair_key: str = "pair",
               mask_key: str = "mask", alloc=None) -> LoadedInput:
    """Read one input file, check it against `pair_dim`, convert the pair to float32 once.

    `alloc(shape)` returns the float32 destination array (pinned host memory for the GPU
    path); it is called only after the header has been checked. Raises `InputError`.
    """
    alloc = alloc or (lambda shape: np.empty(shape, np.float32))
    readers = {"npy": _read_npy, "npz": _read_npz, "hdf5": _read_hdf5}
    if kind not in readers:
        raise InputError(f"unsupported file type (expected one of "
                         f"{', '.join(INPUT_SUFFIXES)})")
    try:
        pair, source_dtype, mask = readers[kind](path, pair_dim, pair_key, mask_key, alloc)
    except (InputError, MemoryError):
        raise
    except Exception as exc:  # zipfile, h5py, numpy header errors, OSError, ...
        raise InputError(f"cannot read the {kind} file (corrupt or truncated?): "
                         f"{type(exc).__name__}: {exc}") from exc
    B, N, batched = pair_geometry(pair.shape, pair_dim)
    _check_finite(pair, "pair")
    if mask is not None:
        mask = _checked_mask(mask, B, N, batched)
    return LoadedInput(pair, mask, B, N, batched, source_dtype)


def _check_header(shape, dtype, pair_dim: int, what: str = "pair"):
    dtype = np.dtype(dtype)
    if dtype.kind != "f" or dtype.itemsize not in (4, 8):  # either byte order
        raise InputError(f"{what} has dtype {np.dtype(dtype)}; expected float32 or float64")
    try:
        pair_geometry(shape, pair_dim, arg=what)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def _convert_into(dest: np.ndarray, src: np.ndarray):
    """dest[...] = src in slabs along the first axis (float64 -> float32 conversion here:
    the one conversion an input goes through)."""
    step = _slab_rows(src)
    with np.errstate(over="ignore"):  # float64 beyond float32's range -> inf, reported
        for i in range(0, src.shape[0], step):
            np.copyto(dest[i:i + step], src[i:i + step], casting="unsafe")


def _slab_rows(arr) -> int:
    row_bytes = max(1, int(np.prod(arr.shape[1:], dtype=np.int64)) * 8)
    return max(1, _SLAB_BYTES // row_bytes)


def _read_npy(path, pair_dim, pair_key, mask_key, alloc):
    fmt = np.lib.format
    with open(path, "rb") as f:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = fmt.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, _, dtype = fmt.read_array_header_2_0(f)
        else:  # version 3.0 (utf-8 field names) has no public reader
            shape, _, dtype = fmt._read_array_header(f, version)
        offset = f.tell()
        size = os.fstat(f.fileno()).st_size
    _check_header(shape, dtype, pair_dim)
    need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size - offset < need:
        raise InputError(f"file is truncated: its header announces {need} bytes of "
                         f"{dtype} {tuple(shape)} data, the file holds {size - offset}")
    # The file is mapped, not read: the one copy is the conversion into `dest`.
    src = np.load(path, mmap_mode="r", allow_pickle=False)
    dest = alloc(tuple(shape))
    _convert_into(dest, src)
    del src
    return dest, str(dtype), None


def _read_npz(path, pair_dim, pair_key, mask_key, alloc):
    if not zipfile.is_zipfile(path):
        raise InputError("not a .npz file (no zip archive found; truncated or corrupt?)")
    with np.load(path, allow_pickle=False) as z:
        if pair_key not in z.files:
            raise InputError(f"no array {pair_key!r} in the archive (it holds "
                             f"{', '.join(map(repr, z.files)) or 'nothing'}); "
                             f"choose one with --pair-key")
        raw = z[pair_key]
        _check_header(raw.shape, raw.dtype, pair_dim)
        mask = z[mask_key] if mask_key in z.files else None
    dest = alloc(raw.shape)
    _convert_into(dest, raw)
    return dest, str(raw.dtype), mask


def _read_hdf5(path, pair_dim, pair_key, mask_key, alloc):
    import h5py

    if not h5py.is_hdf5(path):
        raise InputError("not an HDF5 file (no HDF5 signature found)")
    with h5py.File(path, "r") as f:
        if _attr_str(f.attrs.get("format")) == OUTPUT_FORMAT:
            raise InputError("this is an output of triattn-infer, not an input")
        ds = f.get(pair_key)
        if not isinstance(ds, h5py.Dataset):
            names = []
            f.visititems(lambda name, obj: names.append(name)
                         if isinstance(obj, h5py.Dataset) else None)
            raise InputError(f"no dataset {pair_key!r} in the file (it holds "
                             f"{', '.join(map(repr, names)) or 'no datasets'}); "
                             f"choose one with --pair-key")
        _check_header(ds.shape, ds.dtype, pair_dim)
        dest = alloc(ds.shape)
        step = _slab_rows(ds)
        for i in range(0, ds.shape[0], step):  # HDF5 converts float64 -> float32 here
            sel = np.s_[i:i + step]
            ds.read_direct(dest, source_sel=sel, dest_sel=sel)
        mask = None
        mds = f.get(mask_key)
        if mds is not None:
            if not isinstance(mds, h5py.Dataset):
                raise InputError(f"{mask_key!r} is a group, expected the mask dataset")
            mask = mds[()]
        return dest, str(ds.dtype), mask


def _checked_mask(mask, B, N, batched) -> np.ndarray:
    mask = np.asarray(mask)
    try:
        check_mask_dtype(mask.dtype)
        check_mask_shape(mask.shape, B, N, batched)
    except (TypeError, ValueError) as exc:
        raise InputError(str(exc)) from None
    if mask.dtype.kind == "f":
        _check_finite(mask, "mask")
    return mask != 0  # the semantics of every backend: 0 = masked


def _check_finite(arr: np.ndarray, what: str):
    """InputError naming the count and the first index of NaN/Inf values in `arr`."""
    flat = arr.reshape(-1)
    step = max(1, _SLAB_BYTES // arr.itemsize)
    first, count = None, 0
    for i in range(0, flat.size, step):
        bad = ~np.isfinite(flat[i:i + step])
        n = int(np.count_nonzero(bad))
        if n:
            count += n
            if first is None:
                first = i + int(np.argmax(bad))
    if count:
        index = tuple(int(j) for j in np.unravel_index(first, arr.shape))
        raise InputError(f"{what} contains {count} non-finite value"
                         f"{'s' if count > 1 else ''} (NaN or Inf), the first at index "
                         f"{index} (after conversion to float32)")


# --- writing ------------------------------------------------------------------------------

def temp_path_for(path: str) -> str:
    """A fresh temporary name beside `path`: hidden, unique, ending in TEMP_SUFFIX."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}")


def write_output(path: str, out: np.ndarray, output_format: str, attrs: dict,
                 live_temps: set | None = None) -> None:
    """Write `out` to `path` atomically: into a temporary file in the same folder, flushed
    to disk, then renamed over `path`. On any exception (Ctrl-C included) the temporary
    file is removed and `path` is left as it was. `live_temps`, when given, holds the
    temporary name while it exists, for a last clean-up if the process is torn down."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = temp_path_for(path)
    if live_temps is not None:
        live_temps.add(tmp)
    try:
        if output_format == "npy":
            _write_npy(tmp, out)
        else:
            _write_hdf5(tmp, out, attrs)
        _fsync_path(tmp)
        os.replace(tmp, path)
        _fsync_dir(folder)
    except BaseException:
        remove_quietly(tmp)
        raise
    finally:
        if live_temps is not None:
            live_temps.discard(tmp)


def _write_npy(tmp: str, out: np.ndarray) -> None:
    with open(tmp, "xb") as f:  # "x": never write through an existing name
        np.lib.format.write_array(f, np.ascontiguousarray(out), allow_pickle=False)


def _write_hdf5(tmp: str, out: np.ndarray, attrs: dict) -> None:
    import h5py

    with h5py.File(tmp, "x") as f:
        f.attrs["format"] = OUTPUT_FORMAT
        f.attrs["format_version"] = np.int64(OUTPUT_FORMAT_VERSION)
        for key, value in attrs.items():
            f.attrs[key] = value
        ds = f.create_dataset(OUTPUT_DATASET, shape=out.shape, dtype=np.float32)
        step = _slab_rows(out)
        for i in range(0, out.shape[0], step):
            ds[i:i + step] = out[i:i + step]


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: str) -> None:
    """Make the rename durable; not possible (nor needed) on every platform."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError:
        pass


def sha256_file(path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def _attr_str(value):
    if isinstance(value, (bytes, np.bytes_)):
        return value.decode("utf-8", "replace")
    return value

"""Inputs of `triattn-infer`: finding them, reading and checking them.

Inputs hold a pair representation (N, N, D) or (B, N, N, D), float16, float32 or
float64 (computed in float32; float16 gives a float16 output), and
optionally a mask (N, N) / (B, N, N):

    .npy          the pair array alone
    .npz          arrays named by pair_key / mask_key (defaults "pair", "mask")
    .h5 / .hdf5   datasets at pair_key / mask_key (paths such as "group/pair" work)

Every problem with an input raises `InputError` with a sentence that says what is wrong;
the caller adds the path. Inputs are only ever opened read-only, and only regular files
are opened. Shapes and dtypes are checked from headers and metadata before any data are
read, and HDF5 inputs must hold their data themselves (see `triattn_cupy.hdf5`).
Outputs are written by `triattn_cupy.cli.outputs`.
"""
from __future__ import annotations

import dataclasses
import errno
import math
import os
import stat
import zipfile

import numpy as np

from .._checks import check_mask_dtype, pair_geometry
from ..conventions import check_mask_shape
from ..hdf5 import (ExternalDataError, check_local_storage, local_datasets, local_object,
                    no_filter_plugins, not_a_dataset, storage_problem)
from .outputs import OUTPUT_FORMAT, attr_str
from .runfiles import is_run_file

INPUT_SUFFIXES = {".npy": "npy", ".npz": "npz", ".h5": "hdf5", ".hdf5": "hdf5"}

# Reads, writes and finiteness checks go in slabs of about this many bytes: bounds the
# temporary arrays, and lets h5py's global lock go between slabs, so the reader thread and
# the writer thread take turns instead of one waiting for a whole file.
_SLAB_BYTES = 64 << 20
_BUFFER_BYTES = 4 << 20  # data read to be converted go through a buffer of about this
GIB = float(1 << 30)
# An .npz array of more than NPZ_CHECKED_BYTES may expand at most this many times its
# compressed size: real pairs compress a few times at most (padding included), while a
# bomb of a few MB expands to GBs before anything else could stop it.
NPZ_MAX_EXPANSION = 100
NPZ_CHECKED_BYTES = 64 << 20


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


def special_file_kind(path) -> str | None:
    """None for a regular file (or a link to one); else what it is ("a FIFO", "a
    socket", "a device", "a broken link (to X)", "a link cycle", "missing"). Looks at
    the inode only: opening a FIFO would block until a writer comes."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if not os.path.islink(path):
            return "missing"
        if exc.errno == errno.ELOOP:
            return "a link cycle (links that lead back to themselves)"
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"a broken link (to {target}, which does not exist)"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


def _left_out_reason(path: str) -> str | None:
    """Why the file `path`, found in a folder, is not an input (None: it is one)."""
    special = special_file_kind(path)
    if special is not None:
        if os.path.islink(path):
            return f"{special}; not followed"
        return f"{special}, not a regular file; not opened"
    if os.path.basename(path).startswith("."):
        return "hidden (its name starts with '.'); not taken as input"
    if input_kind(path) is None:
        return "not an input type (.npy, .npz, .h5, .hdf5)"
    return None


def walk_inputs(folder: str, recursive: bool, exclude: str | None = None,
                ignore=None):
    """(input files, left out, sub-folders not searched) under `folder`; only its own
    files unless `recursive`.

    The rule (README, docs/batch.md): a regular file with an input suffix is an input,
    also through a link, wherever the link points; with `recursive`, every sub-folder is
    searched, also through a link, wherever it points, each real folder once (the real
    tree first, then the links, so a folder is named by its own path where it has one;
    files reached without a link of their own come first, for the same reason).
    `left out` lists (path, reason) for everything else found, never passed over in
    silence: another suffix, special files (FIFO, socket, device: never opened), hidden
    files (a name starting with '.'), broken links, link cycles, a link to a folder that
    is searched already or that holds the link. Passed over without a word: a run's own
    hidden files (claims, temporary outputs), paths for which `ignore(path)` is true (the
    .npy outputs' provenance records), and `exclude` (the output folder, when it lies in
    an input folder, so that outputs of an earlier run are not read).
    """
    found, linked_files, left_out, unsearched = [], [], [], []
    exclude = os.path.realpath(exclude) if exclude else None
    searched = {}  # real path of each folder listed -> the path it was listed under
    linked = []  # links to folders, followed once the real tree is listed

    def list_tree(start: str):
        stack = [start]
        while stack:
            here = stack.pop()
            real = os.path.realpath(here)
            if real in searched:
                left_out.append((here, f"the folder {searched[real]}, searched already; "
                                       f"not searched twice"))
                continue
            searched[real] = here
            try:
                entries = sorted(os.scandir(here), key=lambda e: e.name)
            except OSError as exc:
                left_out.append((here, f"a folder that cannot be listed: {exc.strerror}"))
                continue
            subfolders = []
            for entry in entries:
                path = entry.path
                if entry.name.startswith(".") and is_run_file(entry.name):
                    continue
                if ignore is not None and ignore(path):
                    continue
                try:
                    is_folder = entry.is_dir()
                except OSError:
                    is_folder = False
                if is_folder:
                    if os.path.realpath(path) == exclude:
                        continue
                    if not recursive:
                        unsearched.append(path)
                    elif entry.is_symlink():
                        linked.append(path)
                    else:
                        subfolders.append(path)
                    continue
                reason = _left_out_reason(path)
                if reason is None:
                    (linked_files if entry.is_symlink() else found).append(path)
                else:
                    left_out.append((path, reason))
            stack.extend(reversed(subfolders))

    list_tree(folder)
    while linked:
        link = linked.pop(0)
        target = os.path.realpath(link)
        holder = os.path.realpath(os.path.dirname(link))
        if target not in searched and (holder == target or
                                       holder.startswith(target.rstrip(os.sep) + os.sep)):
            left_out.append((link, f"a link cycle (to {target}, a folder that holds the "
                                   f"link); not followed"))
        else:
            list_tree(link)
    return found + linked_files, left_out, unsearched


# --- reading ------------------------------------------------------------------------------

def read_input(path: str, kind: str, *, pair_dim: int, pair_key: str = "pair",
               mask_key: str = "mask", mask_required: bool = False,
               alloc=None, mask_layout: str = "pair") -> LoadedInput:
    """Read one input file, check it against `pair_dim`, convert the pair to float32 once.

    Every shape and dtype is checked from the file's header or metadata before its data
    are read, and `alloc(shape)` (the float32 destination; pinned host memory for the
    GPU path) is called only then. `mask_required`: a file without `mask_key` is an
    error rather than unmasked. `mask_layout` (the weights'): a "row" mask may also be
    stored as the models' (B, N, 1, 1, N) / (N, 1, 1, N), read as (B, N, N) / (N, N).
    Raises `InputError`.
    """
    alloc = alloc or (lambda shape: np.empty(shape, np.float32))
    readers = {"npy": _read_npy, "npz": _read_npz, "hdf5": _read_hdf5}
    if kind not in readers:
        raise InputError(f"unsupported file type (expected one of "
                         f"{', '.join(INPUT_SUFFIXES)})")
    special = special_file_kind(path)
    if special is not None:
        raise InputError(f"{special}, not a regular file; not opened")
    keys = _Keys(pair_dim, pair_key, mask_key, mask_required, mask_layout)
    try:
        pair, source_dtype, mask = readers[kind](path, keys, alloc)
    except (InputError, MemoryError):
        raise
    except ExternalDataError as exc:
        raise InputError(str(exc)) from None
    except Exception as exc:  # zipfile, h5py, numpy header errors, OSError, ...
        raise InputError(f"cannot read the {kind} file (corrupt or truncated?): "
                         f"{type(exc).__name__}: {exc}") from exc
    B, N, batched = pair_geometry(pair.shape, pair_dim)
    _check_finite(pair, "pair")
    if mask is not None:
        mask = _checked_mask(mask, B, N, batched, mask_layout)
    return LoadedInput(pair, mask, B, N, batched, source_dtype)


@dataclasses.dataclass(frozen=True)
class _Keys:
    pair_dim: int
    pair_key: str
    mask_key: str
    mask_required: bool
    mask_layout: str = "pair"


def _check_header(shape, dtype, pair_dim: int, what: str = "pair"):
    """(B, N, batched) of a pair header, after its dtype, shape and size are checked."""
    dtype = np.dtype(dtype)
    if dtype.kind != "f" or dtype.itemsize not in (2, 4, 8):  # either byte order
        raise InputError(f"{what} has dtype {dtype}; expected float16, float32 or float64")
    try:
        geometry = pair_geometry(shape, pair_dim, arg=what)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    need = _count(shape) * 4
    memory = _host_memory_bytes()
    if memory and need > memory:
        raise InputError(f"{what} {tuple(shape)} takes {need / GIB:.1f} GiB as float32, more "
                         f"than this machine's {memory / GIB:.1f} GiB of memory")
    return geometry


def _check_mask_header(shape, dtype, geometry, mask_layout: str = "pair"):
    B, N, batched = geometry
    try:
        check_mask_dtype(np.dtype(dtype))
        check_mask_shape(shape, B, N, batched, mask_layout)
    except (TypeError, ValueError) as exc:
        raise InputError(str(exc)) from None


def _count(shape) -> int:
    return math.prod(int(n) for n in shape)


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def _slab_rows(arr) -> int:
    row_bytes = max(1, _count(arr.shape[1:]) * 8)
    return max(1, _SLAB_BYTES // row_bytes)


def _npy_header(f):
    """(shape, fortran_order, dtype, header bytes) of the .npy stream `f`, through NumPy's
    public header readers. Format 3.0 differs from 2.0 only in allowing UTF-8 field names;
    its header is read as 2.0's (field names would read as Latin-1, and no dtype with
    fields is accepted anyway)."""
    fmt = np.lib.format
    version = fmt.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = fmt.read_array_header_1_0(f)
    elif version in ((2, 0), (3, 0)):
        shape, fortran, dtype = fmt.read_array_header_2_0(f)
    else:
        raise InputError(f"unsupported .npy format version {version[0]}.{version[1]}")
    return shape, fortran, dtype, f.tell()


def _open_regular(path):
    """`path` opened for reading, refusing anything but a regular file without blocking
    (a FIFO swapped in after planning would otherwise block the reader)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InputError("not a regular file; not read")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_npy(path, keys: _Keys, alloc):
    if keys.mask_required:
        raise InputError(f"a .npy file holds the pair alone, without the mask "
                         f"{keys.mask_key!r} that --mask-key names")
    with _open_regular(path) as f:
        shape, fortran, dtype, offset = _npy_header(f)
        size = os.fstat(f.fileno()).st_size
        _check_header(shape, dtype, keys.pair_dim)
        need = _count(shape) * dtype.itemsize
        if size - offset < need:
            raise InputError(f"file is truncated: its header announces {need} bytes of "
                             f"{dtype} {tuple(shape)} data, the file holds {size - offset}")
        # Read, not mapped: a mapped file that shrinks under the reader ends the process
        # with SIGBUS; a read that comes up short is this file's error alone.
        dest = alloc(tuple(shape))
        _stream_into(dest, f, dtype, fortran,
                     f"file changed while being read: its {dtype} {tuple(shape)} data "
                     f"ended early")
    return dest, str(dtype), None


def _read_npz(path, keys: _Keys, alloc):
    with _open_regular(path) as f:
        if not zipfile.is_zipfile(f):
            raise InputError("not a .npz file (no zip archive found; truncated or corrupt?)")
        with zipfile.ZipFile(f) as z:
            members = {name[:-4]: name for name in z.namelist() if name.endswith(".npy")}
            if keys.pair_key not in members:
                raise InputError(f"no array {keys.pair_key!r} in the archive (it holds "
                                 f"{', '.join(map(repr, members)) or 'nothing'}); "
                                 f"choose one with --pair-key")
            pair_info = z.getinfo(members[keys.pair_key])
            mask_info = z.getinfo(members[keys.mask_key]) if keys.mask_key in members else None
            if mask_info is None and keys.mask_required:
                raise InputError(f"no mask {keys.mask_key!r} (--mask-key) in the archive (it "
                                 f"holds {', '.join(map(repr, members))})")
            # Both headers first: nothing is decompressed before the shapes agree.
            shape, fortran, dtype = _npz_member_header(z, pair_info, "pair")
            geometry = _check_header(shape, dtype, keys.pair_dim)
            if mask_info is not None:
                mshape, _, mdtype = _npz_member_header(z, mask_info, "mask")
                _check_mask_header(mshape, mdtype, geometry, keys.mask_layout)
            dest = alloc(tuple(shape))
            with z.open(pair_info) as member:
                _npy_header(member)
                _stream_into(dest, member, dtype, fortran,
                             f"the archive's data for {dtype} {tuple(shape)} end early")
            mask = None
            if mask_info is not None:
                with z.open(mask_info) as member:
                    mask = np.lib.format.read_array(member, allow_pickle=False)
    return dest, str(dtype), mask


def _npz_member_header(z, info, what):
    """(shape, fortran_order, dtype) of one array of an .npz archive, read from its
    header alone; its size must be the one the archive's directory records, and it may
    not expand more than NPZ_MAX_EXPANSION times (from the directory, before reading)."""
    if (info.file_size > NPZ_CHECKED_BYTES
            and info.file_size > NPZ_MAX_EXPANSION * info.compress_size):
        raise InputError(f"{what}: the archive stores {info.compress_size} bytes that expand "
                         f"to {info.file_size}, more than {NPZ_MAX_EXPANSION} times; refused "
                         f"as a compression bomb (save it with numpy.savez, uncompressed, "
                         f"or as .h5)")
    with z.open(info) as member:
        shape, fortran, dtype, header = _npy_header(member)
    if dtype.hasobject:
        raise InputError(f"{what} has dtype {dtype}; object arrays are not read")
    need = header + _count(shape) * dtype.itemsize
    if info.file_size != need:
        raise InputError(f"{what}: its header announces {dtype} {tuple(shape)} "
                         f"({need} bytes with the header) but the archive holds "
                         f"{info.file_size} bytes for it (corrupt?)")
    return shape, fortran, dtype


def _stream_into(dest: np.ndarray, stream, dtype: np.dtype, fortran: bool,
                 ended_early: str):
    """Fill `dest` from the raw array bytes of `stream` in slabs (a slab of the first axis,
    or of the last for Fortran order, whose bytes are those of the transpose); InputError
    `ended_early` when the stream ends first. Bytes of dest's own type (C order) are read
    straight into it; others through one slab-sized buffer, converted from there."""
    view = dest.T if fortran else dest  # C-order view of the bytes in the file
    rows = view.shape[0]
    row_items = _count(view.shape[1:])
    direct = dtype == dest.dtype and not fortran
    # (a buffer that stays in the cache between the read and the conversion)
    step = max(1, (_SLAB_BYTES if direct else _BUFFER_BYTES)
               // max(1, row_items * dtype.itemsize))
    buffer = None if direct else np.empty(min(step, rows) * row_items, dtype)
    with np.errstate(over="ignore"):
        for i in range(0, rows, step):
            n = min(step, rows - i)
            target = view[i:i + n] if direct else buffer[:n * row_items]
            if not _read_exactly(stream, target.reshape(-1).view(np.uint8)):
                raise InputError(ended_early)
            if not direct:
                np.copyto(view[i:i + n], target.reshape((n,) + view.shape[1:]),
                          casting="unsafe")


def _read_exactly(stream, into: np.ndarray) -> bool:
    """Fill the bytes `into` from `stream`; False when the stream ends first."""
    memory = memoryview(into)
    done = 0
    while done < len(memory):
        got = stream.readinto(memory[done:])
        if not got:
            return False
        done += got
    return True


def _read_hdf5(path, keys: _Keys, alloc):
    import h5py

    if not h5py.is_hdf5(path):  # (read_input has checked that it is a regular file)
        raise InputError("not an HDF5 file (no HDF5 signature found)")
    with no_filter_plugins(), h5py.File(path, "r") as f:
        if attr_str(f.attrs.get("format")) == OUTPUT_FORMAT:
            raise InputError("this is an output of triattn-infer, not an input")
        ds = local_object(f, keys.pair_key)
        if not isinstance(ds, h5py.Dataset):
            names = local_datasets(f, [])
            raise InputError(f"no dataset {keys.pair_key!r} in the file (it holds "
                             f"{', '.join(map(repr, names)) or 'no datasets'}); "
                             f"choose one with --pair-key")
        mds = local_object(f, keys.mask_key)
        if not isinstance(mds, h5py.Dataset):
            found = not_a_dataset(f, keys.mask_key)  # damaged is not absent (unmasked)
            if found:
                raise InputError(f"mask {keys.mask_key!r}: {found}")
            mds = None
        if mds is None and keys.mask_required:
            raise InputError(f"no mask {keys.mask_key!r} (--mask-key) in the file")
        # Metadata first: shapes, dtypes, where the data live, how much the file stores.
        if ds.shape is None:
            raise InputError(f"{keys.pair_key!r} has an empty dataspace, no array")
        geometry = _check_header(ds.shape, ds.dtype, keys.pair_dim)
        for dset, name in ((ds, keys.pair_key), (mds, keys.mask_key)):
            if dset is not None:
                check_local_storage(dset, name)
                unreadable = storage_problem(dset, name)
                if unreadable:
                    raise InputError(unreadable)
        if mds is not None:
            if mds.shape is None:
                raise InputError(f"mask {keys.mask_key!r} has an empty dataspace, no array")
            _check_mask_header(mds.shape, mds.dtype, geometry, keys.mask_layout)
        dest = alloc(ds.shape)
        step = _slab_rows(ds)
        for i in range(0, ds.shape[0], step):  # HDF5 converts float64 -> float32 here
            sel = np.s_[i:i + step]
            ds.read_direct(dest, source_sel=sel, dest_sel=sel)
        mask = mds[()] if mds is not None else None
        return dest, str(ds.dtype), mask


def _checked_mask(mask, B, N, batched, mask_layout: str = "pair") -> np.ndarray:
    mask = np.asarray(mask)
    try:
        check_mask_dtype(mask.dtype)
        check_mask_shape(mask.shape, B, N, batched, mask_layout)
    except (TypeError, ValueError) as exc:
        raise InputError(str(exc)) from None
    mask = mask.reshape((B, N, N) if batched else (N, N))  # (the models' unit axes dropped)
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

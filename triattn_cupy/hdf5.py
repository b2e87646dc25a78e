"""Weights as HDF5 files: format version 1 (described in ``weights/README.md``).

One float32 dataset per parameter, at the reference module's state_dict name with ``.``
replaced by ``/`` (``query.weight`` -> ``query/weight``), in PyTorch's
(out_features, in_features) layout. Root attributes: ``format``, ``format_version``,
``pair_dim``, ``num_heads``, ``head_dim``, ``layer_norm_eps``, and the module's conventions
``mask_layout`` and ``node`` (`triattn_cupy.conventions`). A file without ``head_dim``,
``mask_layout`` or ``node``, as written before they existed, is read with head_dim
pair_dim / num_heads, "pair" and "starting".

`load_weights` checks the whole file against `parameter_shapes` before returning and
raises one `WeightsFormatError` that lists every problem it found. Shapes, dtypes and
storage come from the file's metadata and are checked before any data is read. A file
must hold its data itself: external links, external raw storage and virtual datasets are
refused (`ExternalDataError`), so a file can never read another file's bytes; hard links
and soft links that stay inside the file are followed. Only the filters HDF5 and h5py
carry are read (`SUPPORTED_FILTERS`), and HDF5's filter plugins are never loaded while a
file is read (`no_filter_plugins`): a plugin is a shared library run in this process.
Chunks far larger than their dataset, unwritten chunks, and groups nested deeper than
`MAX_GROUP_DEPTH` are refused from the metadata, before any data are read.
"""
from __future__ import annotations

import contextlib
import importlib.resources
import math
import os
import pathlib
import stat
import threading
import uuid

import h5py
import numpy as np

from .conventions import MASK_LAYOUTS, NODES
from .weights import OPTIONAL_BIASES, Weights, parameter_shapes

FORMAT = "triattn-cupy/weights"
FORMAT_VERSION = 1
_PARAM_NAMES = tuple(parameter_shapes(1, 1))  # the names; shapes depend on the attributes
# The largest pair_dim a file may declare: five (D, D) float32 matrices of 64 MiB each.
# Real models are far below it (AlphaFold: 128; the GPU kernels take at most 768); a file
# beyond it is refused before anything is read.
MAX_PAIR_DIM = 4096
_SOFT_LINK_DEPTH = 8
# Groups within groups: a weights file nests 2 deep, an input a few. Deeper is refused,
# and nothing below it is opened (a deep chain cost O(depth^2) to list name by name, and
# HDF5's recursive visit overflowed the C stack).
MAX_GROUP_DEPTH = 32
# The filters a dataset may use: HDF5's own, and h5py's LZF (which h5py registers).
SUPPORTED_FILTERS = {1: "deflate (gzip)", 2: "shuffle", 3: "fletcher32", 4: "szip",
                     5: "nbit", 6: "scaleoffset", 32000: "lzf"}
# A chunk may hold up to max(its dataset's bytes, this): HDF5 reads a chunk whole, so a
# chunk shape far beyond the dataset's would allocate its size on the first read.
CHUNK_BYTES_FLOOR = 1 << 20


class WeightsFormatError(ValueError):
    """A weights file that is missing, unreadable, or not valid format version 1."""


class ExternalDataError(ValueError):
    """An HDF5 object whose data would come from outside its file (an external link,
    external raw storage or a virtual dataset)."""


# --- reading HDF5 safely (weights and inputs) ---------------------------------------------

def local_object(f: h5py.File, path: str, _depth: int = 0):
    """The object at `path` in `f`, reached only through hard links and soft links that
    stay inside the file; None when nothing is there. Raises `ExternalDataError` when
    the path goes through an external link (which would open another file)."""
    node = f["/"]
    parts = [p for p in str(path).split("/") if p]
    for i, part in enumerate(parts):
        if not isinstance(node, h5py.Group) or part not in node:
            return None
        link = node.get(part, getlink=True)
        where = "/".join(parts[:i + 1])
        if isinstance(link, h5py.ExternalLink):
            raise ExternalDataError(
                f"'{where}' is an external link to {link.filename}:{link.path}; refused: "
                f"the file must hold its data itself")
        if isinstance(link, h5py.SoftLink):
            if _depth >= _SOFT_LINK_DEPTH:
                raise ExternalDataError(f"'{where}': soft links nested too deeply")
            target = link.path if link.path.startswith("/") else (
                "/".join(parts[:i] + [link.path]))
            node = local_object(f, target, _depth + 1)
            if node is None:
                return None  # a dangling soft link: nothing there
        else:
            node = node.get(part)
    return node


def not_a_dataset(f: h5py.File, name: str):
    """What is at `name` where no dataset could be reached: None when nothing is (no link;
    or an external link, reported where it is followed), else a sentence. A damaged
    object is never taken for an absent one (an optional bias would read as zeros, an
    optional mask as no mask)."""
    try:
        link = f.get(name, getlink=True)
    except Exception as err:  # a damaged group on the way
        return f"cannot be reached (damaged? {type(err).__name__}: {err})"
    if link is None or isinstance(link, h5py.ExternalLink):
        return None
    try:
        obj = local_object(f, name)
    except Exception as err:
        return f"cannot be opened (damaged? {type(err).__name__}: {err})"
    if obj is None and isinstance(link, h5py.SoftLink):
        return f"missing: a soft link to {link.path!r}, where nothing is"
    if obj is None:  # a hard link whose object HDF5 cannot open
        return "cannot be opened (damaged?)"
    if isinstance(obj, h5py.Group):
        return "is a group, expected a dataset"
    return f"is a {type(obj).__name__} (damaged?), expected a dataset"


def check_local_storage(ds: h5py.Dataset, name: str) -> None:
    """ExternalDataError when the raw data of `ds` lives in other files."""
    if ds.is_virtual:
        raise ExternalDataError(
            f"'{name}' is a virtual dataset (its data are mapped from other files); "
            f"refused: the file must hold its data itself")
    if ds.external:
        files = ", ".join(sorted({str(entry[0]) for entry in ds.external}))
        raise ExternalDataError(
            f"'{name}' keeps its raw data in external files ({files}); refused: the file "
            f"must hold its data itself")


def storage_problem(ds: h5py.Dataset, name: str):
    """A sentence saying why the data of `ds` must not be read, else None: a filter this
    package does not read, chunks far larger than the dataset, or unwritten data (see
    `missing_storage`). From the metadata alone; `check_local_storage` first."""
    return unsupported_filter(ds, name) or oversized_chunks(ds, name) or \
        missing_storage(ds, name)


def unsupported_filter(ds: h5py.Dataset, name: str):
    """A sentence naming the first filter of `ds` not in `SUPPORTED_FILTERS`, else None."""
    plist = ds.id.get_create_plist()
    for index in range(plist.get_nfilters()):
        code, _flags, _values, label = plist.get_filter(index)
        if code not in SUPPORTED_FILTERS:
            label = label.decode("utf-8", "replace") if isinstance(label, bytes) else label
            return (f"'{name}' uses HDF5 filter {code} ({label or 'no name'}), which is "
                    f"not supported: rewrite the file without it (supported: "
                    f"{', '.join(SUPPORTED_FILTERS.values())})")
    return None


def _logical_bytes(ds: h5py.Dataset) -> int:
    return math.prod(int(n) for n in (ds.shape or ())) * ds.dtype.itemsize


def oversized_chunks(ds: h5py.Dataset, name: str):
    """A sentence when one chunk of `ds` is larger than max(the dataset, 1 MiB)."""
    if not ds.chunks:
        return None
    chunk = math.prod(int(n) for n in ds.chunks) * ds.dtype.itemsize
    limit = max(_logical_bytes(ds), CHUNK_BYTES_FLOOR)
    if chunk > limit:
        return (f"'{name}' is stored in chunks of shape {ds.chunks} ({chunk} bytes each) "
                f"for {_logical_bytes(ds)} bytes of data ({ds.dtype} {ds.shape}); refused: "
                f"reading a chunk allocates it whole (at most {limit} bytes are read)")
    return None


def missing_storage(ds: h5py.Dataset, name: str):
    """A sentence when `ds` cannot hold the data its shape declares, else None.

    Unwritten storage reads back as the fill value (zeros), so a dataset whose shape
    promises more bytes than the file stores for it is not data. Without filters the
    stored size is at least the logical size; with compression it is smaller, so a
    chunked dataset must also store every one of its chunks.
    """
    logical = _logical_bytes(ds)
    if logical == 0:
        return None
    stored = ds.id.get_storage_size()
    filtered = ds.id.get_create_plist().get_nfilters() > 0
    if stored == 0 or (not filtered and stored < logical):
        return (f"'{name}' declares {logical} bytes ({ds.dtype} {ds.shape}) but the file "
                f"stores {stored} bytes for it (unwritten data would read as zeros)")
    if ds.chunks:
        expected = math.prod(-(-int(n) // int(c)) for n, c in zip(ds.shape, ds.chunks))
        written = ds.id.get_num_chunks()
        if written < expected:
            return (f"'{name}' ({ds.dtype} {ds.shape}) is stored in {expected} chunks but "
                    f"the file holds {written} of them (unwritten chunks would read as "
                    f"zeros)")
    return None


# Filter plugins stay off while any thread reads a file: the first reader empties HDF5's
# plugin search path, the last one puts it back (it is the process's, shared with h5py).
_plugins_lock = threading.Lock()
_plugins_readers = 0
_plugin_paths: list = []


@contextlib.contextmanager
def no_filter_plugins():
    """HDF5 loads no filter plugin inside this block: its plugin search path is empty.

    A dataset naming a filter HDF5 does not know makes it look for a plugin, a shared
    library whose code it runs, in HDF5_PLUGIN_PATH. Weights and inputs need none
    (`unsupported_filter` refuses them first; this holds for any other read)."""
    global _plugins_readers, _plugin_paths
    with _plugins_lock:
        if _plugins_readers == 0:
            while h5py.h5pl.size():
                _plugin_paths.append(h5py.h5pl.get(0))
                h5py.h5pl.remove(0)
        _plugins_readers += 1
    try:
        yield
    finally:
        with _plugins_lock:
            _plugins_readers -= 1
            if _plugins_readers == 0:
                for path in _plugin_paths:
                    h5py.h5pl.append(path)
                _plugin_paths = []


def local_datasets(f: h5py.File, problems: list) -> dict:
    """{path: Dataset} of every dataset reachable inside `f`, each of its names included
    (a dataset hard-linked under two names appears twice). External links are appended
    to `problems` and not followed; so are groups nested deeper than `MAX_GROUP_DEPTH`
    (once), whose contents are passed over."""
    datasets = {}
    for raw_name in _link_names(f, problems):
        # The names come as bytes: h5py's own visititems_links fails on one that is not
        # UTF-8.
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            problems.append(f"link {raw_name!r}: its name is not UTF-8")
            continue
        try:
            link = f.get(name, getlink=True)
            obj = local_object(f, name)
            if isinstance(obj, h5py.Dataset):
                datasets[name] = obj
        except ExternalDataError as err:
            if isinstance(link, h5py.ExternalLink):
                problems.append(str(err))
        except Exception as err:  # a damaged link or name
            problems.append(f"link '{name}': cannot be followed ({type(err).__name__}: "
                            f"{err})")
    return datasets


def _link_names(f: h5py.File, problems: list) -> list:
    """The full name (bytes) of every link in `f`, group by group, breadth first, through
    hard links to groups at most MAX_GROUP_DEPTH deep (a group reached twice, through
    another hard link or a cycle, is listed once). HDF5's own recursive visit crashed
    the process (a C stack overflow) on 20000 nested groups."""
    names, seen = [], {h5py.h5o.get_info(f.id).addr}
    level = [(b"", f.id)]
    for depth in range(MAX_GROUP_DEPTH + 1):
        deeper = []
        for prefix, group in level:
            here = []
            # The callback only appends: an exception raised inside HDF5's iteration
            # leaves h5py's lock in a broken state (SystemError on every later call).
            group.links.iterate(here.append)
            for child in here:
                names.append(prefix + child)
                try:
                    if group.links.get_info(child).type != h5py.h5l.TYPE_HARD:
                        continue  # soft and external links: followed by name, later
                    info = h5py.h5o.get_info(group, child)
                    if info.type != h5py.h5o.TYPE_GROUP or info.addr in seen:
                        continue
                    seen.add(info.addr)
                    deeper.append((prefix + child + b"/", h5py.h5g.open(group, child)))
                except Exception:  # damaged: its name is listed, and reported there
                    continue
        if deeper and depth == MAX_GROUP_DEPTH:
            shown = deeper[0][0][:60].decode("utf-8", "replace")
            problems.append(f"groups nested more than {MAX_GROUP_DEPTH} deep (at "
                            f"'{shown}...'); refused")
        level = deeper
    return names


def dataset_name(param: str) -> str:
    """The HDF5 path of a state_dict name: ``"query.weight"`` -> ``"query/weight"``."""
    return param.replace(".", "/")


# --- reading ----------------------------------------------------------------------------

def load_weights(path) -> Weights:
    """Read and validate a format-version-1 weights file.

    Returns `Weights` with float32 arrays; absent linear biases are zeros. Raises
    `WeightsFormatError` for a missing or non-HDF5 file, a file of another format or
    version, and for every problem with its attributes and datasets (all in one message).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise WeightsFormatError(f"{path}: no such file")
    if os.path.isdir(path):
        raise WeightsFormatError(f"{path}: is a folder, expected an HDF5 weights file")
    if not os.path.isfile(path):  # a FIFO or device: opening it could block
        raise WeightsFormatError(f"{path}: not a regular file, expected an HDF5 weights file")
    try:
        _check_readable(path)
        is_hdf5 = h5py.is_hdf5(path)
    except OSError as err:  # permissions, I/O errors: say so, not "corrupt"
        raise WeightsFormatError(f"{path}: cannot be read: "
                                 f"{err.strerror or err}") from err
    if not is_hdf5:
        raise WeightsFormatError(f"{path}: not an HDF5 file (no HDF5 signature found)")
    try:
        with no_filter_plugins(), h5py.File(path, "r") as f:
            return _read(f, path)
    except WeightsFormatError:
        raise
    except (OSError, RuntimeError, KeyError, TypeError, ValueError,
            SystemError) as err:  # a corrupt file (h5py may raise any of them)
        raise WeightsFormatError(
            f"{path}: cannot read the HDF5 file (truncated or corrupt?): {err}") from err


def _check_readable(path: str) -> None:
    """OSError (PermissionError, ...) when `path` cannot be opened for reading; opened
    without blocking, and only as a regular file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
    finally:
        os.close(fd)


def _read(f: h5py.File, path: str) -> Weights:
    fmt = _as_str(f.attrs.get("format"))
    if fmt != FORMAT:
        found = _describe_attr(f, "format") if fmt is None else repr(fmt)
        raise WeightsFormatError(
            f"{path}: not a triattn-cupy weights file: root attribute 'format' is {found}, "
            f"expected {FORMAT!r}")
    version = _as_int(f.attrs.get("format_version"))
    if version != FORMAT_VERSION:
        raise WeightsFormatError(
            f"{path}: unsupported format_version {_describe_attr(f, 'format_version')}; "
            f"this version of triattn-cupy reads format_version {FORMAT_VERSION}")

    problems = []
    pair_dim = _positive_int_attr(f, "pair_dim", problems)
    num_heads = _positive_int_attr(f, "num_heads", problems)
    # Absent (files written before it existed): pair_dim / num_heads, checked below.
    head_dim = _positive_int_attr(f, "head_dim", problems) if "head_dim" in f.attrs else None
    eps = _as_float(f.attrs.get("layer_norm_eps"))
    if eps is None or not math.isfinite(eps) or eps <= 0:
        problems.append(f"root attribute 'layer_norm_eps': expected a positive finite "
                        f"number, got {_describe_attr(f, 'layer_norm_eps')}")
    mask_layout = _convention_attr(f, "mask_layout", MASK_LAYOUTS, problems)
    node = _convention_attr(f, "node", NODES, problems)
    if pair_dim and pair_dim > MAX_PAIR_DIM:
        problems.append(f"root attribute 'pair_dim': {pair_dim} is beyond the largest this "
                        f"package reads, {MAX_PAIR_DIM}")
        pair_dim = None
    if pair_dim and num_heads and num_heads > pair_dim:
        problems.append(f"root attributes: num_heads {num_heads} is more than pair_dim "
                        f"{pair_dim}")
        num_heads = None
    if num_heads and head_dim and num_heads * head_dim > MAX_PAIR_DIM:
        problems.append(f"root attributes: num_heads x head_dim = {num_heads} x {head_dim} "
                        f"is beyond the largest this package reads, {MAX_PAIR_DIM}")
        num_heads = None
    if pair_dim and num_heads and "head_dim" not in f.attrs and pair_dim % num_heads:
        problems.append(f"root attributes: pair_dim {pair_dim} must be a multiple of "
                        f"num_heads {num_heads} (or a head_dim attribute given)")
        pair_dim = None
    shapes = (parameter_shapes(pair_dim, num_heads, head_dim)
              if pair_dim and num_heads and (head_dim or "head_dim" not in f.attrs) else None)

    datasets = local_datasets(f, problems)
    params = {}
    for param in _PARAM_NAMES:
        name = dataset_name(param)
        expected = shapes[param] if shapes else None
        if name not in datasets:
            found = not_a_dataset(f, name)
            if found:  # present: damaged, or of another kind; never read as absent
                problems.append(f"dataset '{name}': {found}")
            elif param not in OPTIONAL_BIASES:
                detail = f"float32 of shape {expected}" if expected else "float32"
                problems.append(f"dataset '{name}': missing (required; expected {detail})")
            continue
        value = _read_dataset(datasets[name], name, expected, problems)
        if value is not None:
            params[param] = value
    for name in sorted(set(datasets) - {dataset_name(p) for p in _PARAM_NAMES}):
        ds = datasets[name]
        problems.append(f"dataset '{name}': unexpected (shape {ds.shape}, dtype {ds.dtype}); "
                        f"format version {FORMAT_VERSION} has no such parameter")

    if problems:
        unchecked = "" if shapes else " (dataset shapes not checked)"
        raise WeightsFormatError(
            f"{path}: invalid triattn-cupy weights file, {len(problems)} problem"
            f"{'s' if len(problems) > 1 else ''}{unchecked}:\n  - " + "\n  - ".join(problems))
    try:
        return Weights(pair_dim, num_heads, eps, params, mask_layout=mask_layout, node=node,
                       head_dim=head_dim)
    except ValueError as err:  # not expected after the checks above; keep the file name
        raise WeightsFormatError(f"{path}: {err}") from err


def _read_dataset(ds: h5py.Dataset, name: str, expected, problems: list):
    """The dataset as float32, or None after appending its problems."""
    # float16 and float64 (either byte order) are rounded to float32; nothing else is read.
    if ds.dtype.kind != "f" or ds.dtype.itemsize not in (2, 4, 8):
        problems.append(f"dataset '{name}': expected dtype float32 (float16 and float64 "
                        f"are converted), got {ds.dtype}")
        return None
    if ds.shape is None or (expected is not None and ds.shape != expected):
        got = "an empty dataspace" if ds.shape is None else ds.shape
        problems.append(f"dataset '{name}': expected shape {expected or '(any)'}, got {got}")
        return None
    if expected is None and (len(ds.shape) not in (1, 2)
                             or max(ds.shape, default=0) > MAX_PAIR_DIM):
        # The attributes are broken, so the exact shapes are unknown; read no more than
        # the largest valid parameter could hold.
        problems.append(f"dataset '{name}': shape {ds.shape} fits no parameter (1 or 2 "
                        f"axes of at most {MAX_PAIR_DIM})")
        return None
    try:
        check_local_storage(ds, name)
    except ExternalDataError as err:
        problems.append(f"dataset {err}")
        return None
    unreadable = storage_problem(ds, name)
    if unreadable:
        problems.append(f"dataset {unreadable}")
        return None
    raw = np.asarray(ds[()])
    bad = ~np.isfinite(raw)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        problems.append(
            f"dataset '{name}': expected finite values, got {int(np.isnan(raw).sum())} NaN "
            f"and {int(np.isinf(raw).sum())} Inf (first at index {first})")
        return None
    with np.errstate(over="ignore"):  # reported below, with the value
        value = raw.astype(np.float32)
    if not np.all(np.isfinite(value)):
        problems.append(f"dataset '{name}': values of dtype {raw.dtype} overflow float32 "
                        f"(largest magnitude {np.abs(raw).max()})")
        return None
    return value


def _as_str(value):
    if isinstance(value, (bytes, np.bytes_)):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def _as_int(value):
    """A scalar integer attribute as int, else None (bools and floats are not integers)."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    value = np.asarray(value)
    return int(value) if value.shape == () and value.dtype.kind in "iu" else None


def _as_float(value):
    if value is None or isinstance(value, (str, bytes)):
        return None
    value = np.asarray(value)
    return float(value) if value.shape == () and value.dtype.kind in "iuf" else None


def _describe_attr(f: h5py.File, name: str) -> str:
    if name not in f.attrs:
        return "missing"
    value = f.attrs[name]
    return repr(value.item() if isinstance(value, np.generic) else value)


def _convention_attr(f: h5py.File, name: str, allowed: tuple, problems: list) -> str:
    """A convention attribute's value; absent: the first allowed value (the spec's)."""
    if name not in f.attrs:
        return allowed[0]
    value = _as_str(f.attrs[name])
    if value not in allowed:
        problems.append(f"root attribute '{name}': expected one of {allowed}, got "
                        f"{_describe_attr(f, name)}")
        return allowed[0]
    return value


def _positive_int_attr(f: h5py.File, name: str, problems: list):
    value = _as_int(f.attrs.get(name))
    if value is None or value < 1:
        problems.append(f"root attribute '{name}': expected a positive integer, got "
                        f"{_describe_attr(f, name)}")
        return None
    return value


# --- writing ----------------------------------------------------------------------------

def save_weights(weights: Weights, path) -> None:
    """Write `weights` as a format-version-1 file, atomically.

    Every parameter is written as float32, zero biases included. The file is written
    under a temporary name in the same folder and then renamed over `path`, so readers
    never see a half-written file and a failed write leaves an existing `path` intact.
    """
    if not isinstance(weights, Weights):
        raise TypeError(f"weights must be a triattn_cupy.Weights, got {type(weights).__name__}")
    eps = weights.layer_norm_eps
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"weights.layer_norm_eps must be a positive finite number, got {eps}")
    if weights.pair_dim > MAX_PAIR_DIM:  # never write a file load_weights refuses
        raise ValueError(f"weights.pair_dim {weights.pair_dim} is beyond the largest "
                         f"load_weights reads, {MAX_PAIR_DIM}")
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path}: folder {folder} does not exist")
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with h5py.File(tmp, "x") as f:  # "x": fail rather than overwrite
            _write(f, weights)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _write(f: h5py.File, weights: Weights) -> None:
    f.attrs["format"] = FORMAT
    f.attrs["format_version"] = np.int64(FORMAT_VERSION)
    f.attrs["pair_dim"] = np.int64(weights.pair_dim)
    f.attrs["num_heads"] = np.int64(weights.num_heads)
    f.attrs["head_dim"] = np.int64(weights.head_dim)
    f.attrs["layer_norm_eps"] = np.float64(weights.layer_norm_eps)
    f.attrs["mask_layout"] = weights.mask_layout
    f.attrs["node"] = weights.node
    for param in parameter_shapes(weights.pair_dim, weights.num_heads, weights.head_dim):
        f.create_dataset(dataset_name(param),
                         data=np.ascontiguousarray(weights[param], dtype=np.float32))


# --- shipped weights --------------------------------------------------------------------

def default_weights_path():
    """Where the shipped ``default.h5`` is (reference module, pair_dim 128, 4 heads, seed 0).

    ``importlib.resources.files("triattn_cupy.default_weights") / "default.h5"`` in an
    installed package; in a source checkout run without installing (``PYTHONPATH=.``),
    where that subpackage is not importable, the ``weights/`` folder of the checkout.
    """
    try:
        return importlib.resources.files("triattn_cupy.default_weights") / "default.h5"
    except ModuleNotFoundError:
        return pathlib.Path(__file__).resolve().parent.parent / "weights" / "default.h5"


def load_default_weights() -> Weights:
    """`load_weights` of `default_weights_path`."""
    with importlib.resources.as_file(default_weights_path()) as path:
        return load_weights(path)

"""Outputs of `triattn-infer`: atomic writes, provenance, and what lies at an output path.

Outputs are written by `write_output` under a temporary name in their final folder and
renamed into place (`os.replace`, atomic on POSIX) only when complete and flushed to
disk, so an output file that exists is always complete. Temporary names say who writes
them (`runfiles.temp_path_for`), so that a later run can remove those whose writer has
gone (`runfiles.remove_left_behind`), after a SIGKILL or a power cut.

Provenance, which tells our outputs apart from files this tool never wrote:

- HDF5 outputs carry the root attribute ``format = OUTPUT_FORMAT`` and attributes that
  record the input, the weights and the options;
- a ``.npy`` output has no room for attributes (NumPy refuses extra header keys), so the
  same record goes to a sidecar ``<name>.npy.json`` with the array file's size and
  SHA-256. It is renamed into place just before the array, so an array without a valid
  record is never ours: a "foreign" file, reported and left alone.

Only a file proven ours is ever replaced: an HDF5 file that cannot be opened, or has no
``format`` attribute of ours, is foreign, whatever its name.

Text attributes are stored as UTF-8 strings; a path that is not valid UTF-8 (a file name
in another encoding, which Python holds with surrogate escapes) is stored as its bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat

import numpy as np

from .runfiles import temp_path_for

OUTPUT_SUFFIXES = {"hdf5": ".h5", "npy": ".npy"}
OUTPUT_FORMAT = "triattn-cupy/infer-output"
OUTPUT_FORMAT_VERSION = 1
OUTPUT_DATASET = "out"
PROVENANCE_SUFFIX = ".json"  # appended to the .npy name
_SLAB_BYTES = 64 << 20


def output_path(output_dir: str, rel: str, output_format: str) -> str:
    """`output_dir/rel` with the suffix of `output_format` in place of the input's."""
    stem = os.path.splitext(rel)[0]
    return os.path.join(output_dir, stem + OUTPUT_SUFFIXES[output_format])


def provenance_path(npy_path: str) -> str:
    return npy_path + PROVENANCE_SUFFIX


def is_provenance_record(path) -> bool:
    """True for a ``.npy.json`` file that `write_output` wrote (never raises)."""
    path = os.fspath(path)
    return path.endswith(".npy" + PROVENANCE_SUFFIX) and _read_record(path) is not None


def is_infer_output(path) -> bool:
    """True for a file written by `write_output` (never raises)."""
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".npy":
        return existing_output_state(path, "npy")[0] in ("complete", "broken")
    if suffix not in (".h5", ".hdf5") or not _regular(path):
        return False
    try:
        import h5py
        with h5py.File(path, "r") as f:
            return attr_str(f.attrs.get("format")) == OUTPUT_FORMAT
    except Exception:
        return False


def existing_output_state(path, output_format: str, *, verify: bool = False):
    """What lies at an output path: ("missing" | "complete" | "foreign" | "broken", attrs).

    "complete": an output of ours that reads back (its recorded attributes are returned);
    "foreign": a file that is not proven ours (an HDF5 file that cannot be opened or has
    no format attribute of ours, a .npy without our provenance record, anything but a
    regular file), never to be replaced (attrs: the "reason" when it cannot be read);
    "broken": ours but incomplete or unreadable, to be recomputed. `verify`: also check
    a .npy's SHA-256 against its record (a .npy changed since we wrote it is foreign).
    """
    if not os.path.lexists(path):
        return "missing", {}
    if not _regular(path):
        return "foreign", {}
    if output_format == "npy":
        return _npy_state(path, verify)
    import h5py
    try:
        with h5py.File(path, "r") as f:
            if attr_str(f.attrs.get("format")) != OUTPUT_FORMAT:
                return "foreign", {}
            if not isinstance(f.get(OUTPUT_DATASET), h5py.Dataset):
                return "broken", {}
            return "complete", {k: attr_str(v) if isinstance(v, (bytes, str)) else v
                                for k, v in f.attrs.items()}
    except Exception as exc:  # not even an HDF5 file we could have written: not ours
        return "foreign", {"reason": f"cannot be read as HDF5 ({_one_line(exc)})"}


def _npy_state(path: str, verify: bool):
    record = _read_record(provenance_path(path))
    if record is None:
        return "foreign", {}
    if record.get("array") != os.path.basename(path):
        return "foreign", {}
    try:
        size = os.path.getsize(path)
        if size != record.get("bytes"):
            # Ours, caught between the record's rename and the array's (or cut short).
            return "broken", record
        np.load(path, mmap_mode="r", allow_pickle=False)  # header and size agree
    except Exception:
        return "broken", record
    if verify and sha256_file(path) != record.get("sha256"):
        return "foreign", {}
    return "complete", record


def _read_record(path: str):
    """The provenance record at `path` as a dict, or None when it is not one of ours."""
    if not _regular(path):
        return None
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read(1 << 20).decode("utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != OUTPUT_FORMAT:
        return None
    return record


def _one_line(exc: BaseException) -> str:
    """An exception as one line (HDF5's messages can run over several)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


# --- writing ------------------------------------------------------------------------------

def write_output(path: str, out: np.ndarray, output_format: str, attrs: dict,
                 live_temps: set | None = None) -> None:
    """Write `out` to `path` atomically: into a temporary file in the same folder, flushed
    to disk, then renamed over `path` (a .npy's provenance record first). On any exception
    (Ctrl-C included) the temporary files are removed and `path` is left as it was.
    `live_temps`, when given, holds the temporary names while they exist, for a last
    clean-up if the process is torn down."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    temps = [temp_path_for(path)]
    if output_format == "npy":
        temps.append(temp_path_for(provenance_path(path)))
    if live_temps is not None:
        live_temps.update(temps)
    try:
        if output_format == "npy":
            digest, size = _write_npy(temps[0], out)
            record = {"format": OUTPUT_FORMAT, "format_version": OUTPUT_FORMAT_VERSION,
                      "array": os.path.basename(path), "bytes": size, "sha256": digest,
                      **{k: _jsonable(v) for k, v in attrs.items()}}
            with open(temps[1], "x", encoding="utf-8") as f:
                json.dump(record, f, indent=1, sort_keys=True)
            _fsync_path(temps[0])
            _fsync_path(temps[1])
            os.replace(temps[1], provenance_path(path))
        else:
            _write_hdf5(temps[0], out, attrs)
            _fsync_path(temps[0])
        os.replace(temps[0], path)
        _fsync_dir(folder)
    except BaseException:
        for tmp in temps:
            remove_quietly(tmp)
        raise
    finally:
        if live_temps is not None:
            live_temps.difference_update(temps)


class _HashingWriter:
    """A write-only file object that hashes and counts what goes through it (NumPy then
    writes the array in chunks through `write`)."""

    def __init__(self, f):
        self.f, self.digest, self.size = f, hashlib.sha256(), 0

    def write(self, data):
        self.digest.update(data)
        self.size += len(data)
        return self.f.write(data)


def _write_npy(tmp: str, out: np.ndarray):
    """(SHA-256, size) of the .npy written to `tmp`."""
    with open(tmp, "xb") as f:  # "x": never write through an existing name
        writer = _HashingWriter(f)
        np.lib.format.write_array(writer, np.ascontiguousarray(out), allow_pickle=False)
    return writer.digest.hexdigest(), writer.size


def _write_hdf5(tmp: str, out: np.ndarray, attrs: dict) -> None:
    import h5py

    with h5py.File(tmp, "x") as f:
        f.attrs["format"] = OUTPUT_FORMAT
        f.attrs["format_version"] = np.int64(OUTPUT_FORMAT_VERSION)
        for key, value in attrs.items():
            f.attrs[key] = _hdf5_attr(value)
        ds = f.create_dataset(OUTPUT_DATASET, shape=out.shape, dtype=out.dtype)
        step = max(1, _SLAB_BYTES // max(1, out[:1].nbytes))
        for i in range(0, out.shape[0], step):
            ds[i:i + step] = out[i:i + step]


def _hdf5_attr(value):
    """`value` as HDF5 stores it: text that is not valid UTF-8 (a surrogate-escaped file
    name) as its bytes, as the filesystem has them."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return np.bytes_(os.fsencode(value))
    return value


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


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


# --- helpers ---------------------------------------------------------------------------

def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def sha256_file(path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def attr_str(value):
    if isinstance(value, (bytes, np.bytes_)):
        return value.decode("utf-8", "replace")
    return value

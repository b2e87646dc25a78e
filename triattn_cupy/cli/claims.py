"""Claims: several `triattn-infer` runs (processes, or hosts sharing a filesystem) split
one batch instead of computing every file twice.

Before an output is computed, its run creates the claim file ``.<output name>.claim``
beside it, holding the claimant's host, process id, a start time and a random token. The
record is written whole under a temporary name first and then hard-linked to the claim's
name (`link` fails if the name exists, atomically, also on NFS), so a claim never exists
half-written: a run killed at any instant leaves either no claim or one that names it, and
the next run can tell that its holder is gone. Where the filesystem has no hard links the
claim is created with ``O_CREAT | O_EXCL`` and written in place. Another run that finds
the claim leaves that output alone. A claim is released (removed) once its output is
written or has failed, and expires when its holder is gone:

- on the same host, when the holder's process no longer exists;
- from another host, whose processes cannot be seen, when the claim file has not been
  refreshed for `timeout` seconds. A holder refreshes (touches) its claims every
  `timeout / 10` seconds, so a live run's claims never look that old, whatever the size
  of the file it computes.

An expired claim is removed and taken over. Two runs that break the same expired claim
at the same instant can both compute that output; the output stays whole (each write is
atomic), only the work is done twice.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import socket
import stat
import threading
import time
import uuid

logger = logging.getLogger("triattn_cupy.cli")

CLAIM_SUFFIX = ".claim"
TEMP_SUFFIX = ".tmp"
DEFAULT_TIMEOUT = 600.0  # seconds without a refresh before another host's claim expires
# A claim file that does not parse may be one being written in place this instant (a
# filesystem without hard links).
_UNREADABLE_GRACE = 30.0
# link() errors that mean the filesystem has no hard links (then: O_EXCL in place).
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK,
                  errno.EXDEV}


def host_name() -> str:
    return socket.gethostname() or "localhost"


def host_token(host: str | None = None) -> str:
    """The host name reduced to letters, digits and '-', for use inside file names."""
    return re.sub(r"[^A-Za-z0-9-]", "-", host or host_name())[:40] or "host"


def process_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host (a zombie counts as gone where /proc
    tells)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return True  # cannot tell: assume alive, never break a live claim
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def holder_gone(host: str, pid: int, age: float, timeout: float) -> bool:
    """Whether the writer (`host`, `pid`) of a file last touched `age` seconds ago has
    ended: by process id on this host, by age on another host."""
    if host == host_token():
        return not process_alive(pid)
    return age > timeout


def temp_path_for(path: str) -> str:
    """A fresh temporary name beside `path`: hidden, unique, naming this host and process
    (so that `outputs.remove_stale_temps` can tell when its writer has gone), ending in
    TEMP_SUFFIX. Used for outputs and for claims."""
    folder, name = os.path.split(path)
    tag = f"{host_token()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return os.path.join(folder, f".{name.lstrip('.')}.{tag}{TEMP_SUFFIX}")


def claim_path(output: str) -> str:
    folder, name = os.path.split(output)
    return os.path.join(folder, f".{name}{CLAIM_SUFFIX}")


class Claims:
    """The claims of one run: `acquire`, `release`, and a thread that refreshes those
    held. A context manager; leaving it releases every claim still held."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT):
        self.timeout = float(timeout)
        self.host = host_token()
        self.pid = os.getpid()
        self.started = time.time()
        self._held = {}  # output -> (claim path, token)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        self._thread = threading.Thread(target=self._refresh_loop, daemon=True,
                                        name="triattn-claims")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for output in list(self._held):
            self.release(output)
        return False

    def acquire(self, output: str, live_temps=None) -> str | None:
        """Claim `output`. None when claimed; else a sentence naming the live holder.
        `live_temps`, when given, holds the name of the claim's temporary file while it
        exists (as `write_output`'s does), so that a cluster run can remove it after a
        worker killed there."""
        path = claim_path(output)
        token = uuid.uuid4().hex
        record = json.dumps({"host": self.host, "pid": self.pid, "started": time.time(),
                             "token": token, "output": os.path.basename(output)}).encode()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        for _ in range(2):  # a second try after breaking an expired claim
            try:
                _create_whole(path, record, live_temps)
            except FileExistsError:
                holder = self._expired_holder(path)
                if isinstance(holder, str):
                    return holder
                continue
            with self._lock:
                self._held[output] = (path, token)
            return None
        return "claimed by another run (its claim was just renewed)"

    def release(self, output: str) -> None:
        """Remove the claim of `output` if this run still holds it."""
        with self._lock:
            held = self._held.pop(output, None)
        if held is None:
            return
        path, token = held
        record = _read_record(path)
        if record is not None and record.get("token") != token:
            return  # broken as expired and taken over: not ours to remove
        try:
            os.remove(path)
        except OSError:
            pass

    def held(self) -> list:
        with self._lock:
            return list(self._held)

    def _expired_holder(self, path: str):
        """True after removing the expired claim at `path`; else a sentence on its holder
        (the claim is alive)."""
        try:
            age = time.time() - os.stat(path).st_mtime
        except FileNotFoundError:
            return True  # released meanwhile: try again
        record = _read_record(path)
        if record is None:
            if age < _UNREADABLE_GRACE:
                return "claimed by another run (its claim file is being written)"
            gone = True
            who = "an unreadable claim"
        else:
            host, pid = str(record.get("host")), _int(record.get("pid"))
            gone = holder_gone(host, pid, age, self.timeout)
            who = f"host {host}, process {pid}"
            if host == self.host and pid == self.pid:
                return "claimed by this run already (the output is named twice?)"
        if not gone:
            return f"being computed by another run ({who}; claimed {age:.0f} s ago)"
        if _read_record(path) != record:  # changed meanwhile: look again
            return True
        try:
            os.remove(path)
            logger.info("%s: took over the claim of %s, which has ended", path, who)
        except FileNotFoundError:
            pass
        except OSError as exc:
            return f"claimed by {who}, which has ended, but its claim cannot be removed: {exc}"
        return True

    def _refresh_loop(self):
        interval = max(0.05, min(60.0, self.timeout / 10))
        while not self._stop.wait(interval):
            with self._lock:
                paths = [path for path, _ in self._held.values()]
            for path in paths:
                try:
                    os.utime(path)
                except OSError as exc:
                    if exc.errno != errno.ENOENT:
                        logger.debug("cannot refresh the claim %s: %s", path, exc)


def _create_whole(path: str, record: bytes, live_temps=None) -> None:
    """Create the file `path` holding `record`, or raise FileExistsError if it exists.
    The record goes to a temporary file (`temp_path_for`: one left by a killed run is
    removed by the next), which is then hard-linked to `path` and removed. `live_temps`
    (a set, or None) holds the temporary name from before it is created until it is
    removed."""
    temp = temp_path_for(path)
    if live_temps is not None:
        live_temps.add(temp)
    try:
        _link_whole(temp, path, record)
    finally:
        try:
            os.remove(temp)
        except OSError:
            pass
        if live_temps is not None:
            live_temps.discard(temp)


def _link_whole(temp: str, path: str, record: bytes) -> None:
    """Write `record` to the new file `temp`, then give it the name `path` too (where
    there are no hard links: write `path` in place, which a kill can leave empty, taken
    for a claim being written until _UNREADABLE_GRACE has passed)."""
    _write_new(temp, record)
    try:
        os.link(temp, path)
    except OSError as exc:
        # Over NFS a link can succeed on the server and still report an error (EEXIST for
        # a retried request whose reply was lost): the temporary file's link count tells
        # whether it has its second name.
        if os.stat(temp).st_nlink == 2:
            return
        if exc.errno not in _NO_HARD_LINKS:
            raise
        _write_new(path, record)


def _write_new(path: str, record: bytes) -> None:
    """Create `path` (FileExistsError if it exists) and write `record` into it."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, record)
    finally:
        os.close(fd)


def _read_record(path: str):
    """The JSON object in the claim file `path`, or None. Opened without blocking and
    read only if it is a regular file (something else could sit at that name)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        record = json.loads(os.read(fd, 4096).decode("utf-8"))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return record if isinstance(record, dict) else None


def _int(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def remove_expired_claims(folder: str, timeout: float) -> list:
    """Remove the claims in `folder` whose holder has gone; return their paths."""
    removed = []
    try:
        entries = [e for e in os.scandir(folder)
                   if e.name.startswith(".") and e.name.endswith(CLAIM_SUFFIX)]
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        record = _read_record(entry.path)
        if record is None:
            gone = age > max(timeout, _UNREADABLE_GRACE)
        else:
            gone = holder_gone(str(record.get("host")), _int(record.get("pid")), age, timeout)
        if gone and _read_record(entry.path) == record:
            try:
                os.remove(entry.path)
                removed.append(entry.path)
            except OSError:
                pass
    return removed

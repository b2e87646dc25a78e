"""Claims: several `triattn-infer` runs (processes, or hosts sharing a filesystem) split
one batch instead of computing every file twice.

Before an output is computed, its run creates the claim file ``.<output name>.claim``
beside it, holding the claimant's host, boot, process id and the process's start time,
the random id of its run, a start time and a random token (`runfiles.holder_record`). The
record is written whole under a temporary name first and then hard-linked to the claim's
name (`link` fails if the name exists, atomically, also on NFS), so a claim never exists
half-written: a run killed at any instant leaves either no claim or one that names it, and
the next run can tell that its holder is gone. Where the filesystem has no hard links the
claim is created with ``O_CREAT | O_EXCL`` and written in place. Another run that finds
the claim leaves that output alone. A claim is a run's own only if it carries that run's
id: a claim naming this host and this process id that another run made (a container
restarted with the same host name and process id) is not. A claim is released (removed)
once its output is written or has failed, and expires when its holder is gone
(`runfiles.claim_holder_ended`):

- on the same host, when the holder's process no longer exists, or its id is held by a
  process that started at another time (the id was reused);
- from another host, whose processes cannot be seen, when the claim file has not been
  refreshed for `timeout` seconds. A holder refreshes (touches) its claims every
  `timeout / 10` seconds, so a live run's claims never look that old, whatever the size
  of the file it computes.

An expired claim is removed and taken over. Two runs that break the same expired claim
at the same instant can both compute that output; the output stays whole (each write is
atomic), only the work is done twice. Something at a claim's name that no run can judge
(a folder, a link, another machine's claim dated more than `timeout` in the future, an
expired claim that cannot be removed) raises `ClaimConflict`: its output is reported
failed, never skipped for ever.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import stat
import threading
import time
import uuid

from .runfiles import (UNREADABLE_GRACE, claim_holder_ended, claim_path, holder_record,
                       judged_by_age, live_runs, read_claim, temp_path_for)

logger = logging.getLogger("triattn_cupy.cli")

DEFAULT_TIMEOUT = 600.0  # seconds without a refresh before another host's claim expires
# link() errors that mean the filesystem has no hard links (then: O_EXCL in place).
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK,
                  errno.EXDEV}


class ClaimConflict(Exception):
    """Something at a claim's name that no run can take over or wait for; the message
    names it and says what to do."""


class Claims:
    """The claims of one run: `acquire`, `release`, and a thread that refreshes those
    held. A context manager; leaving it releases every claim still held. `run_id`, random,
    tells this run's claims from any other's, also from those of an earlier process that
    had this host name and process id."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT):
        self.timeout = float(timeout)
        self.run_id = uuid.uuid4().hex
        self.holder = holder_record(self.run_id)
        self.started = time.time()
        self._held = {}  # output -> (claim path, token)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        live_runs.add(self.run_id)

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
        live_runs.discard(self.run_id)
        return False

    def acquire(self, output: str, live_temps=None) -> str | None:
        """Claim `output`. None when claimed; else a sentence naming the live holder.
        Raises ClaimConflict for something at the claim's name that no run can judge,
        OSError when the claim cannot be written. `live_temps`, when given, holds the
        name of the claim's temporary file while it exists (as `write_output`'s does), so
        that a cluster run can remove it after a worker killed there."""
        path = claim_path(output)
        token = uuid.uuid4().hex
        record = json.dumps({**self.holder, "started": time.time(), "token": token,
                             "output": os.fsdecode(os.path.basename(output))}).encode()
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
        record = read_claim(path)
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
        (the claim is alive). Raises ClaimConflict."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return True  # released meanwhile: try again
        if not stat.S_ISREG(st.st_mode):
            kind = "a folder" if stat.S_ISDIR(st.st_mode) else (
                "a link" if stat.S_ISLNK(st.st_mode) else "not a regular file")
            raise ClaimConflict(f"its claim {path} is {kind}, not a claim file of "
                                f"triattn-infer; remove it to compute this output")
        age = time.time() - st.st_mtime
        record = read_claim(path)
        if record is None:
            if age < UNREADABLE_GRACE:
                return "claimed by another run (its claim file is being written)"
            gone = True
            who = "an unreadable claim"
        else:
            if record.get("run") == self.run_id:
                return "claimed by this run already (the output is named twice?)"
            who = f"host {record.get('host')}, process {record.get('pid')}"
            if -age > self.timeout and judged_by_age(record):
                raise ClaimConflict(
                    f"its claim {path} ({who}) is dated {-age:.0f} s in the future: the "
                    f"clocks disagree by more than --claim-timeout ({self.timeout:g} s), "
                    f"or it was set so; remove it if no run is computing this output")
            gone = claim_holder_ended(record, age, self.timeout)
        if not gone:
            return f"being computed by another run ({who}; claimed {max(age, 0):.0f} s ago)"
        if read_claim(path) != record:  # changed meanwhile: look again
            return True
        try:
            os.remove(path)
            logger.info("%s: took over the claim of %s, which has ended", path, who)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise ClaimConflict(f"its claim {path} was made by {who}, which has ended, but "
                                f"cannot be removed: {exc}") from None
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
    for a claim being written until UNREADABLE_GRACE has passed)."""
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


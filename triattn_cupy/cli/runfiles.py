"""The hidden files a `triattn-infer` run keeps beside its outputs while it works, their
names, who holds them, and the one sweep that removes those whose holder has ended.

    .<name>.<host>-<pid>-s<start>-<8 hex>.tmp   a temporary output, or a claim's record
                                                before it is linked into place
    .<name>.claim                               a claim (`claims`), a JSON record

A name that would exceed NAME_MAX (255 bytes) keeps the first bytes of <name> and a hash
of the whole name, so every output name the filesystem takes has a claim and temporary
names too.

A holder is one process of one host. On this host (the same host name and, where the
kernel tells, the same boot) a holder has ended when its process id is gone, or is now
held by a process that started at another time (`<start>`, the process's start in clock
ticks since boot, tells): process ids are reused, and a container restarted with the same
host name gives its new run the process id of the old one. A claim records the start time
as well and the random id of its run. From another host, whose processes cannot be seen,
a holder has ended when its file has not been refreshed for `timeout` seconds.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import socket
import stat
import time
import uuid

CLAIM_SUFFIX = ".claim"
TEMP_SUFFIX = ".tmp"
NAME_MAX = 255  # bytes in one file name, on the filesystems in use (ext4, XFS, NFS, ...)
_HASH_CHARS = 16
_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<host>[A-Za-z0-9-]+)-(?P<pid>\d+)"
                        r"(?:-s(?P<start>\d+))?-[0-9a-f]{8}\.tmp$", re.DOTALL)
# Temporary names without their writer (".<name>.<12 hex>.tmp", older versions): by age.
_ANONYMOUS_TEMP_NAME = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$", re.DOTALL)
# A claim file that does not parse may be one being written in place this instant (a
# filesystem without hard links): it is respected this long.
UNREADABLE_GRACE = 30.0
# A claim record of at most this size is read (a record is about 300 bytes).
_RECORD_BYTES = 4096
# The run ids of this process's live claims (`claims.Claims`, from creation until left):
# a claim naming this process is alive only if its run id is here.
live_runs = set()


# --- this host and its processes ----------------------------------------------------------

def host_name() -> str:
    return socket.gethostname() or "localhost"


def host_token(host: str | None = None) -> str:
    """The host name reduced to letters, digits and '-', for use inside file names."""
    return re.sub(r"[^A-Za-z0-9-]", "-", host or host_name())[:40] or "host"


@functools.lru_cache(maxsize=None)
def boot_id() -> str:
    """This boot of this host's kernel ("" where the system does not say): a host name
    seen with another boot id is another machine, or this one before a reboot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (None where unknown: no
    /proc, or no such process). Two processes that held one id in turn differ here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The fields after the command name's ")": state is field 3, starttime 22.
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


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


def process_ended(pid: int, start: int | None) -> bool:
    """Whether the process `pid` of this host that started at `start` (None: unknown) has
    ended: its id is gone, or another process holds it now."""
    if not process_alive(pid):
        return True
    if start is None:
        return False
    now = process_start(pid)
    return now is not None and now != start


# --- names --------------------------------------------------------------------------------

def fit_name(name: str, room: int) -> str:
    """`name` if it takes at most `room` bytes; else its first bytes, '~' and a hash of
    the whole name, `room` bytes in all (the same for the same name on every host)."""
    raw = os.fsencode(name)
    if len(raw) <= room:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:_HASH_CHARS]
    return os.fsdecode(raw[:room - _HASH_CHARS - 1]) + "~" + digest


def claim_path(output: str) -> str:
    folder, name = os.path.split(output)
    room = NAME_MAX - 1 - len(CLAIM_SUFFIX)
    return os.path.join(folder, f".{fit_name(name, room)}{CLAIM_SUFFIX}")


def temp_path_for(path: str) -> str:
    """A fresh temporary name beside `path`: hidden, unique, naming this host and process
    (so that `remove_left_behind` can tell when its writer has ended), ending in
    TEMP_SUFFIX. Used for outputs and for claims."""
    folder, name = os.path.split(path)
    start = process_start(os.getpid())
    tag = f"{host_token()}-{os.getpid()}{'' if start is None else f'-s{start}'}-" \
          f"{uuid.uuid4().hex[:8]}"
    room = NAME_MAX - 2 - len(tag) - len(TEMP_SUFFIX)
    return os.path.join(folder, f".{fit_name(name.lstrip('.'), room)}.{tag}{TEMP_SUFFIX}")


def is_run_file(name: str) -> bool:
    """Whether a file name is one of a run's hidden files (a claim, a temporary file)."""
    return name.startswith(".") and (
        name.endswith(CLAIM_SUFFIX) or bool(_TEMP_NAME.match(name))
        or bool(_ANONYMOUS_TEMP_NAME.match(name)))


# --- claim records ------------------------------------------------------------------------

def holder_record(run_id: str) -> dict:
    """Who holds a claim made now by this process for the run `run_id`."""
    return {"host": host_token(), "boot": boot_id(), "pid": os.getpid(),
            "pid_start": process_start(os.getpid()), "run": run_id}


def read_claim(path: str):
    """The JSON object in the claim file `path`, or None. Opened without blocking and
    read only if it is a regular file (something else could sit at that name)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) |
                     getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        record = json.loads(os.read(fd, _RECORD_BYTES).decode("utf-8"))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return record if isinstance(record, dict) else None


def judged_by_age(record: dict) -> bool:
    """Whether the holder of the claim `record` is another machine (another host name,
    or this one with another boot: a machine of the same name, or this one before a
    reboot), whose processes cannot be seen: its claim expires by age alone."""
    boot = record.get("boot")
    return (str(record.get("host")) != host_token()
            or bool(boot and boot_id() and boot != boot_id()))


def claim_holder_ended(record: dict, age: float, timeout: float) -> bool:
    """Whether the holder of the claim `record`, last refreshed `age` seconds ago, has
    ended."""
    if record.get("run") in live_runs:
        return False
    if judged_by_age(record):
        return age > timeout
    pid = _int(record.get("pid"))
    if pid == os.getpid():
        return True  # this process, which holds no live run of that id
    start = record.get("pid_start")
    if "run" not in record:  # an older version's record: by its process, else by age
        return process_ended(pid, None) or age > timeout
    return process_ended(pid, start if isinstance(start, int) else None)


def _int(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


# --- the sweep ----------------------------------------------------------------------------

def remove_left_behind(folder: str, timeout: float):
    """Remove the temporary files and the claims in `folder` whose holder has ended
    (killed, or on a host that crashed); return (temporary files, claims) removed. An
    unreadable claim goes once older than max(timeout, UNREADABLE_GRACE); a claim that
    is not a regular file, or another machine's dated in the future, is left for the run
    that meets it to report."""
    temps, claims = [], []
    try:
        entries = [e for e in os.scandir(folder) if e.name.startswith(".")]
    except OSError:
        return temps, claims
    now = time.time()
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        age = now - st.st_mtime
        if entry.name.endswith(CLAIM_SUFFIX):
            record = read_claim(entry.path)
            if record is None:
                gone = age > max(timeout, UNREADABLE_GRACE)
            else:
                gone = claim_holder_ended(record, age, timeout)
            if gone and read_claim(entry.path) == record and _remove(entry.path):
                claims.append(entry.path)
            continue
        match = _TEMP_NAME.match(entry.name)
        if match is not None:
            if match["host"] != host_token():
                gone = age > timeout
            else:
                start = match["start"]
                gone = process_ended(int(match["pid"]), None if start is None else int(start))
        elif _ANONYMOUS_TEMP_NAME.match(entry.name):
            gone = age > timeout
        else:
            continue
        if gone and _remove(entry.path):
            temps.append(entry.path)
    return temps, claims


def _remove(path: str) -> bool:
    try:
        os.remove(path)
        return True
    except OSError:
        return False

"""Planning a `triattn-infer` run: which files are inputs, where their outputs go, and
which outputs are skipped (done already), refused (they would replace an input or a
file this tool did not write) or recomputed. Nothing is read but headers."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

from .claims import remove_expired_claims
from .io import input_kind, special_file_kind, walk_inputs
from .outputs import (existing_output_state, is_infer_output, is_provenance_record,
                      output_path, remove_stale_temps)

logger = logging.getLogger("triattn_cupy.cli")


@dataclasses.dataclass
class Task:
    """One input to compute: `rel` names it in messages and mirrors it under the output
    folder."""

    input: str
    kind: str
    rel: str
    output: str = ""
    output_mtime: int | None = None  # of the file at `output` when planned (None: none)


@dataclasses.dataclass
class Outcome:
    input: str
    status: str  # "done" | "skipped" | "failed"
    reason: str = ""
    positions: int = 0
    device: str = ""
    not_input: bool = False  # a file found in a folder that is not an input (skipped)


def plan(args, output_dir: str, weights_sha: str, claim_timeout: float):
    """(tasks to compute, outcomes decided without computing: failed or skipped)."""
    outcomes = []
    found = []  # Task per input
    seen = set()
    for given in args.inputs:
        if os.path.isdir(given):
            files, passed_over = walk_inputs(given, args.recursive, exclude=output_dir,
                                             ignore=is_provenance_record)
            for path, reason in passed_over:
                logger.debug("%s: skipped: %s", path, reason)
                outcomes.append(Outcome(path, "skipped", reason, not_input=True))
            if not files:
                hint = ""
                if not args.recursive and any(e.is_dir() for e in os.scandir(given)):
                    hint = " (it has sub-folders: add --recursive)"
                logger.warning("%s: no input files (.npy, .npz, .h5, .hdf5) in this "
                               "folder%s", given, hint)
            entries = [(f, os.path.relpath(f, given), True) for f in files]
        elif os.path.isfile(given):
            entries = [(given, os.path.basename(given), False)]
        elif os.path.exists(given):  # a FIFO, socket or device: never opened
            reason = f"{special_file_kind(given)}, not a regular file; not opened"
            logger.warning("%s: skipped: %s", given, reason)
            outcomes.append(Outcome(given, "skipped", reason, not_input=True))
            continue
        else:
            outcomes.append(_fail(given, "no such file or folder"))
            continue
        for path, rel, from_folder in entries:
            real = os.path.realpath(path)
            if real in seen:
                continue  # named twice (a file and its folder): computed once
            seen.add(real)
            kind = input_kind(path)
            if kind is None:
                outcomes.append(_fail(path, "unsupported file type (expected .npy, .npz, "
                                            ".h5 or .hdf5)"))
            elif from_folder and is_infer_output(path):
                logger.debug("%s: an output of triattn-infer, not an input; ignored", path)
                outcomes.append(Outcome(path, "skipped", "an output of triattn-infer"))
            else:
                found.append(Task(os.path.abspath(path), kind, rel))
    if not found and all(o.not_input for o in outcomes):
        return [], outcomes

    inputs_real = {os.path.realpath(t.input): t.input for t in found}
    inputs_inode = {}
    for t in found:
        with contextlib.suppress(OSError):
            st = os.stat(t.input)
            inputs_inode[(st.st_dev, st.st_ino)] = t.input
    destinations = {}  # real output path -> the input it comes from
    tasks, resumed, stale = [], [], []
    for task in found:
        task.output = output_path(output_dir, task.rel, args.output_format)
        real_out = os.path.realpath(task.output)
        victim = inputs_real.get(real_out)
        if victim is None and os.path.exists(task.output):
            st = os.stat(task.output)
            victim = inputs_inode.get((st.st_dev, st.st_ino))
        if victim is not None:
            outcomes.append(_fail(task.input, f"its output {task.output} would overwrite the "
                                              f"input {victim}; choose another --output-dir"))
            continue
        if real_out in destinations:
            first = destinations[real_out]
            outcomes.append(_fail(task.input, f"its output {task.output} is also the output "
                                              f"of {first}; rename one of them"))
            continue
        destinations[real_out] = task.input
        # With --overwrite a .npy is about to be replaced: its checksum must still be ours.
        state, attrs = existing_output_state(task.output, args.output_format,
                                             verify=args.overwrite)
        if state == "foreign":
            what = ("has no provenance record of triattn-infer "
                    f"({os.path.basename(task.output)}.json) or does not match it"
                    if args.output_format == "npy" else "is not an output of triattn-infer")
            outcomes.append(_fail(task.input, f"{task.output} exists and {what}; refusing "
                                              f"to replace it (conflict)"))
            continue
        if state == "broken":
            logger.warning("%s exists but cannot be read (not a complete output); it will be "
                           "recomputed", task.output)
        elif state == "complete" and not args.overwrite:
            resumed.append(task)
            outcomes.append(Outcome(task.input, "skipped", "output exists"))
            made = (attrs.get("weights_sha256"), attrs.get("fully_masked"),
                    attrs.get("precision"))
            if attrs and made != (weights_sha, args.fully_masked,
                                  getattr(args, "precision", None) or "fp32"):
                stale.append(task.output)
            continue
        task.output_mtime = _mtime_ns(task.output)
        tasks.append(task)
    _clean_up_after_ended_runs({os.path.dirname(t.output) for t in found}, claim_timeout)
    if resumed:
        logger.info("resuming: %d of %d output%s exist already and are skipped "
                    "(--overwrite recomputes them)", len(resumed), len(found),
                    "s" if len(found) > 1 else "")
    if stale:
        shown = ", ".join(stale[:5]) + (f" and {len(stale) - 5} more" if len(stale) > 5 else "")
        logger.warning("%d existing output%s were made with other weights or options and "
                       "were kept (--overwrite recomputes them): %s", len(stale),
                       "s" if len(stale) > 1 else "", shown)
    return tasks, outcomes


def _fail(path, reason) -> Outcome:
    logger.error("%s: %s", path, reason)
    return Outcome(path, "failed", reason)


def _clean_up_after_ended_runs(folders, timeout: float) -> None:
    """Remove the temporary outputs and the claims that runs which have ended (killed,
    or on a host that crashed) left in the folders this run writes to."""
    temps, claims = [], []
    for folder in sorted(folders):
        temps += remove_stale_temps(folder, timeout)
        claims += remove_expired_claims(folder, timeout)
    if temps:
        logger.info("removed %d temporary file%s left by runs that have ended: %s",
                    len(temps), "s" if len(temps) > 1 else "", ", ".join(temps[:5]) +
                    (f" and {len(temps) - 5} more" if len(temps) > 5 else ""))
    if claims:
        logger.debug("removed %d expired claims: %s", len(claims), ", ".join(claims))


def _mtime_ns(path: str):
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None

"""Planning a `triattn-infer` run: which files are inputs, where their outputs go, and
which outputs are skipped (done already), refused (they would replace an input or a
file this tool did not write) or recomputed. Nothing is read but headers."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os

from .io import input_kind, special_file_kind, walk_inputs
from .outputs import (PROVENANCE_SUFFIX, existing_output_state, is_infer_output,
                      is_provenance_record, output_path)
from .runfiles import NAME_MAX, remove_left_behind

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
    """What became of one input: `reason` is one line (a multi-line message, as HDF5's,
    is joined), so the summary keeps one line per file."""

    input: str
    status: str  # "done" | "skipped" | "failed"
    reason: str = ""
    positions: int = 0
    device: str = ""
    not_input: bool = False  # a file found in a folder that is not an input (skipped)

    def __post_init__(self):
        if "\n" in self.reason or "\r" in self.reason:
            self.reason = " ".join(self.reason.split())


def plan(args, output_dir: str, weights_sha: str, claim_timeout: float):
    """(tasks to compute, outcomes decided without computing: failed or skipped)."""
    outcomes = []
    found = []  # Task per input
    seen = set()
    seen = {}  # real path -> the path it was taken under
    for given in args.inputs:
        if os.path.isdir(given):
            files, left_out, unsearched = walk_inputs(given, args.recursive,
                                                      exclude=output_dir,
                                                      ignore=is_provenance_record)
            for path, reason in left_out:
                logger.debug("%s: skipped: %s", path, reason)
                outcomes.append(Outcome(path, "skipped", reason, not_input=True))
            if unsearched:
                logger.info("%s: %d sub-folder%s not searched (add --recursive): %s", given,
                            len(unsearched), "s" if len(unsearched) > 1 else "",
                            _listed(unsearched))
            if not files:
                hint = " (it has sub-folders: add --recursive)" if unsearched else ""
                logger.warning("%s: no input files (.npy, .npz, .h5, .hdf5) in this "
                               "folder%s", given, hint)
            entries = [(f, os.path.relpath(f, given), True) for f in files]
        elif os.path.isfile(given):
            entries = [(given, os.path.basename(given), False)]
        elif os.path.islink(given):  # broken, or a cycle: named, so it fails
            outcomes.append(_fail(given, f"{special_file_kind(given)}"))
            continue
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
            if real in seen:  # named twice, or linked: computed once
                reason = f"the same file as {seen[real]}, taken once"
                logger.debug("%s: skipped: %s", path, reason)
                outcomes.append(Outcome(path, "skipped", reason, not_input=True))
                continue
            seen[real] = path
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
        if (args.output_format == "npy" and len(os.fsencode(os.path.basename(
                task.output) + PROVENANCE_SUFFIX)) > NAME_MAX):
            outcomes.append(_fail(task.input, f"the name of its output's provenance record "
                                              f"{os.path.basename(task.output)}"
                                              f"{PROVENANCE_SUFFIX} is over {NAME_MAX} bytes; "
                                              f"shorten the input's name or use "
                                              f"--output-format hdf5"))
            continue
        # With --overwrite a .npy is about to be replaced: its checksum must still be ours.
        state, attrs = existing_output_state(task.output, args.output_format,
                                             verify=args.overwrite)
        if state == "foreign":
            what = ("has no provenance record of triattn-infer "
                    f"({os.path.basename(task.output)}.json) or does not match it"
                    if args.output_format == "npy" else "is not an output of triattn-infer")
            if attrs.get("reason"):
                what += f" (it {attrs['reason']})"
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
        logger.warning("%d existing output%s were made with other weights or options and "
                       "were kept (--overwrite recomputes them): %s", len(stale),
                       "s" if len(stale) > 1 else "", _listed(stale))
    return tasks, outcomes


def _fail(path, reason) -> Outcome:
    outcome = Outcome(path, "failed", reason)
    logger.error("%s: %s", path, outcome.reason)
    return outcome


def _listed(paths, shown: int = 5) -> str:
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more


def _clean_up_after_ended_runs(folders, timeout: float) -> None:
    """Remove the temporary outputs and the claims that runs which have ended (killed,
    or on a host that crashed) left in the folders this run writes to."""
    temps, claims = [], []
    for folder in sorted(folders):
        removed = remove_left_behind(folder, timeout)
        temps += removed[0]
        claims += removed[1]
    if temps:
        logger.info("removed %d temporary file%s left by runs that have ended: %s",
                    len(temps), "s" if len(temps) > 1 else "", _listed(temps))
    if claims:
        logger.debug("removed %d expired claims: %s", len(claims), ", ".join(claims))


def _mtime_ns(path: str):
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None

"""Progress and the closing summary of a `triattn-infer` run."""
from __future__ import annotations

import functools
import logging
import sys
import time

from .outputs import OUTPUT_DATASET

logger = logging.getLogger("triattn_cupy.cli")


def si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


@functools.lru_cache(maxsize=None)
def tqdm_or_none():
    try:
        from tqdm import tqdm
        return tqdm
    except ImportError:
        return None


class Progress:
    """A tqdm bar (files, pair positions/s, ETA), or a throttled log line without tqdm."""

    def __init__(self, total: int, quiet: bool):
        self.total, self.quiet = total, quiet
        self.count = self.positions = 0
        self.start = self.last_log = time.perf_counter()
        tqdm = None if quiet else tqdm_or_none()
        self.bar = (tqdm(total=total, unit="file", desc="triattn-infer", file=sys.stderr,
                         dynamic_ncols=True, smoothing=0.3) if tqdm else None)

    def add(self, outcome):
        self.count += 1
        self.positions += outcome.positions
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rate = f"{si(self.positions / elapsed)} pairs/s"
        if self.bar is not None:
            self.bar.set_postfix_str(rate, refresh=False)
            self.bar.update(1)
        elif not self.quiet:
            now = time.perf_counter()
            if now - self.last_log >= 2.0 or self.count in (1, self.total):
                self.last_log = now
                eta = elapsed / self.count * (self.total - self.count)
                logger.info("[%d/%d files] %s, ETA %s", self.count, self.total, rate,
                            _duration(eta))

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def report(result, output_dir: str, output_format: str):
    done, skipped, failed = (result.count(s) for s in ("done", "skipped", "failed"))
    total = len(result.outcomes)
    logger.info("%d file%s: %d computed, %d skipped, %d failed", total,
                "s" if total != 1 else "", done, skipped, failed)
    if done:
        seconds = max(result.seconds, 1e-9)
        if len(result.devices) > 1:
            per = [f"{d}: {sum(o.device == d for o in result.outcomes)} files"
                   for d in result.devices]
            where = ", ".join(per)
        else:
            where = result.devices[0]
        logger.info("time %.2f s, %s pair positions/s (B*N*N summed over %d file%s), on %s",
                    result.seconds, si(result.positions / seconds), done,
                    "s" if done != 1 else "", where)
        fmt = (f"HDF5, dataset {OUTPUT_DATASET!r}" if output_format == "hdf5"
               else "NumPy .npy")
        logger.info("outputs in %s (%s)", output_dir, fmt)
    if result.interrupted:
        logger.error("interrupted: %d file%s not processed; run the same command again to "
                     "resume", result.not_processed, "s were" if result.not_processed != 1
                     else " was")
    others = [o for o in result.outcomes if o.not_input]
    if others:
        lines = [f"  {o.input}: {o.reason}" for o in others[:20]]
        if len(others) > 20:
            lines.append(f"  ... and {len(others) - 20} more")
        logger.warning("%d file%s skipped, not taken as input%s:\n%s", len(others),
                       "s" if len(others) > 1 else "", "s" if len(others) > 1 else "",
                       "\n".join(lines))
    if failed:
        bad = [o for o in result.outcomes if o.status == "failed"]
        lines = [f"  {o.input}: {o.reason}" for o in bad[:20]]
        if len(bad) > 20:
            lines.append(f"  ... and {len(bad) - 20} more")
        logger.error("%d file%s failed:\n%s", failed, "s" if failed > 1 else "",
                     "\n".join(lines))

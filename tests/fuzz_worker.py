"""The child process of the fuzz suite (tests/test_fuzz.py): runs one case at a time under
a memory limit and answers in one JSON line per case.

    python fuzz_worker.py LIMIT_BYTES     then, on stdin, one JSON request per line:

    {"op": "load_weights", "path": P}
    {"op": "read_input", "path": P, "kind": K, "pair_dim": D, "mask_required": bool,
     "shrink_to": optional size the file is cut to once its headers are checked}
    {"op": "reference", "path": NPZ, "pair_dim": D, "num_heads": h, "seed": s}
    {"op": "cli", "argv": [...]}
    {"op": "sleep", "seconds": s}

Answer: {"status": "ok" | "refused" | "crash", "type": exception type, "message": text,
"result": ...}. "refused" is the documented error of the function (WeightsFormatError,
InputError); any other exception, MemoryError included, is a "crash".
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback


def main():
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    import numpy as np

    from triattn_cupy import hdf5, random_weights, reference
    from triattn_cupy.cli import io as cli_io
    from triattn_cupy.cli import main as cli_main

    def load_weights(req):
        w = hdf5.load_weights(req["path"])
        return {"pair_dim": w.pair_dim, "num_heads": w.num_heads}

    def read_input(req):
        def alloc(shape):  # called once the headers are checked, before the data are read
            if "shrink_to" in req:
                os.truncate(req["path"], req["shrink_to"])
            return np.empty(shape, np.float32)

        loaded = cli_io.read_input(req["path"], req["kind"], pair_dim=req["pair_dim"],
                                   mask_required=req.get("mask_required", False),
                                   alloc=alloc)
        return {"shape": list(loaded.pair.shape), "mask": loaded.mask is not None}

    def run_reference(req):
        with np.load(req["path"]) as z:
            pair = z["pair"]
            mask = z["mask"] if "mask" in z.files else None
        weights = random_weights(req["pair_dim"], req["num_heads"], seed=req["seed"])
        got = reference.triangle_attention(pair.astype(np.float32), mask, weights,
                                           dtype=np.float32)
        want = reference.triangle_attention(pair.astype(np.float64), mask, weights,
                                            dtype=np.float64)
        finite = bool(np.isfinite(got).all() and np.isfinite(want).all())
        den = float(np.linalg.norm(want)) if finite else 0.0
        err = float(np.linalg.norm(got - want)) / den if den else (0.0 if finite else None)
        return {"finite": finite, "rel_err": err}

    def run_cli(req):
        return {"exit": cli_main.main(req["argv"])}

    def sleep(req):  # for the test of the time limit itself
        time.sleep(req["seconds"])

    ops = {"load_weights": (load_weights, hdf5.WeightsFormatError),
           "read_input": (read_input, cli_io.InputError),
           "reference": (run_reference, (ValueError, TypeError)),
           "cli": (run_cli, ()),
           "sleep": (sleep, ())}
    out = sys.stdout
    sys.stdout = sys.stderr  # anything printed by the code under test stays off the channel
    for line in sys.stdin:
        req = json.loads(line)
        func, refusal = ops[req["op"]]
        try:
            answer = {"status": "ok", "result": func(req)}
        except refusal as exc:
            answer = {"status": "refused", "type": type(exc).__name__, "message": str(exc)}
        except BaseException as exc:  # MemoryError, SystemExit, a bug: all crashes here
            answer = {"status": "crash", "type": type(exc).__name__,
                      "message": "".join(traceback.format_exception(exc))[-3000:]}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

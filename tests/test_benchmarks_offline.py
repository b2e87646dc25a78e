"""Offline tests of the benchmark suite (benchmarks/): everything that runs without a GPU.

The CLI, the FLOP/byte model, the inputs, the timing loop on a host timer, the report from a
fabricated results dict, trifast's autotune-cache reuse on a fake module, the worker that
times ours on a NumPy-backed stand-in for CuPy, and a whole dry run on the CPU.
"""
from __future__ import annotations

import json
import math
import pathlib
import sys
import types

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import common, report, roofline, timing  # noqa: E402
from benchmarks import run as bench_run  # noqa: E402
from spec import CANDIDATES as SPEC_CANDIDATES, find_spec_file  # noqa: E402


# -- CLI -------------------------------------------------------------------------------------

def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as info:
        bench_run.main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--sizes", "--quick", "--systems", "--out", "--peer-site", "--budget"):
        assert flag in text


def test_list_systems(capsys):
    assert bench_run.main(["--list-systems"]) == 0
    names = capsys.readouterr().out
    for name in ("ref_eager", "ref_eager_tf32", "sdpa", "cueq_bf16", "trifast_fp32",
                 "ref_compile", "ours_"):
        assert name in names


def test_parse_args_defaults_and_quick():
    args = bench_run.parse_args([])
    assert [str(s) for s in args.sizes] == common.DEFAULT_SIZES.split(",")
    assert len(args.sizes) == 8 and not args.no_compile
    quick = bench_run.parse_args(["--quick", "--systems", "ours, cueq"])
    assert len(quick.sizes) == 3 and quick.no_compile and quick.systems == ["ours", "cueq"]
    assert bench_run.parse_args(["--acc-sizes", "none"]).acc_sizes == []


@pytest.mark.parametrize("bad", ["1x256x128", "1x256x128x3", "0x8x8x1", "ax8x8x1"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="BxNxDxh|divisible|positive"):
        common.parse_size(bad)


def test_system_filter():
    sel = common.selected
    assert sel("ours_fp32", None)
    assert sel("trifast_bf16", ["trifast"]) and sel("trifast_fp32", ["trifast"])
    assert sel("cueq_bf16", ["*_bf16"]) and not sel("cueq_fp32", ["*_bf16"])
    assert not sel("ref_eager_tf32", ["ref_eager"])  # a full name selects itself alone
    assert sel("ref_eager_tf32", ["ref"]) and sel("ref_compile", ["ref"])
    assert not sel("sdpa", ["ref"])
    assert bench_run._wants_ours(None) and bench_run._wants_ours(["ours"])
    assert bench_run._wants_ours(["ours_bf16"]) and not bench_run._wants_ours(["sdpa"])


# -- the model -------------------------------------------------------------------------------

def test_flop_counts_match_the_peers_readme():
    # shared/peers/README.md: 53 GFLOP at N=384, 723 GFLOP at N=1024 (B=1, D=128, h=4).
    assert roofline.forward_flops(1, 384, 128, 4) == pytest.approx(53.3e9, rel=2e-3)
    assert roofline.forward_flops(1, 1024, 128, 4) == pytest.approx(723e9, rel=1e-3)
    assert roofline.attention_core_flops(1, 1024, 128) == 512 * 1024 ** 3
    assert roofline.projection_flops(1, 1, 128, 4) == 164_864
    assert roofline.min_bytes(1, 384, 128) == 384 * 384 * (128 * 8 + 4)
    c = roofline.NOMINAL_H200
    f = roofline.floor_ms(1, 1024, 128, 4, c, core="fp32")
    assert f["bound"] == "compute" and f["floor_ms"] == pytest.approx(14.17, rel=1e-2)
    assert roofline.floor_ms(1, 1024, 128, 4, c, core="tf32")["floor_ms"] == \
        pytest.approx(1.78, rel=1e-2)
    mixed = roofline.floor_ms(1, 4096, 128, 4, c, core="bf16", proj="fp32")
    assert mixed["floor_ms"] > roofline.floor_ms(1, 4096, 128, 4, c, core="bf16")["floor_ms"]
    assert roofline.achieved(1, 1024, 128, 4, 14.17)["TFLOPs"] == pytest.approx(51, rel=1e-2)
    with pytest.raises(ValueError, match="precision class"):
        roofline.rate_key("fp8")


def test_precision_classes():
    pc = roofline.precision_classes
    assert pc("cueq_bf16") == ("bf16", "fp32")
    assert pc("ref_eager_tf32") == ("tf32", "tf32")
    assert pc("sdpa") == ("fp32", "fp32")
    assert pc("ours_bf16", "bf16") == ("bf16", "bf16")
    assert pc("ours_fp32", None) == ("fp32x3", "fp32x3")  # split products, tensor cores
    assert pc("ours_tf32", "tf32") == ("f16", "f16")  # one fp16 product of scaled operands
    c = dict(roofline.NOMINAL_H200)
    assert roofline.rate(c, "fp32x3") == pytest.approx(c["bf16_TFLOPs"] / 3)
    assert roofline.rate(c, "f16") == c["bf16_TFLOPs"]


def test_padding_mask_like_the_peers():
    mask = common.padding_mask(2, 20)
    assert mask.shape == (2, 20, 20) and mask.dtype == np.float32
    L = 18
    assert mask[:, :L, :L].min() == 1 and mask[:, :L, L:].max() == 0
    assert (mask[:, L:, 0] == 1).all() and mask[:, L:, 1:].max() == 0
    assert (mask.sum(-1) > 0).all()  # no query is fully masked
    pair, m2 = common.host_inputs(common.parse_size("1x8x16x4"))
    pair2, _ = common.host_inputs(common.parse_size("1x8x16x4"))
    assert pair.dtype == np.float32 and pair.shape == (1, 8, 8, 16)
    np.testing.assert_array_equal(pair, pair2)  # identical in every process


def test_rel_l2_never_passes_nan():
    ref = np.ones((2, 3))
    assert common.rel_l2(ref * 1.001, ref)["rel_l2"] == pytest.approx(1e-3)
    bad = ref.copy()
    bad[0, 0] = np.nan
    r = common.rel_l2(bad, ref)
    assert r["rel_l2"] == math.inf and r["nonfinite"] == 1
    assert common.rel_l2(np.ones(3), ref)["rel_l2"] == math.inf


def test_error_classification():
    class OutOfMemoryError(RuntimeError):
        pass
    assert common.is_oom(OutOfMemoryError("x"))
    assert common.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not common.is_oom(RuntimeError("shape mismatch"))
    assert common.is_fatal(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not common.is_fatal(RuntimeError("out of memory"))
    assert common.gpu_slug("NVIDIA H200") == "NVIDIA-H200"
    assert common.gpu_slug("") == "unknown-gpu"


# -- timing ----------------------------------------------------------------------------------

def test_measure_on_the_host_timer():
    calls = []

    def fn(i):
        calls.append(i)
        return i

    m = timing.measure(fn, timing.WallTimer(), target_s=0.001, min_reps=4, max_reps=6)
    assert 4 <= m["runs"] <= 6 and len(m["ms_all"]) == m["runs"]
    assert m["ms_min"] <= m["ms"] <= m["ms_max"]
    assert calls[0] == 0 and m["warmup_calls"] >= 3  # first call, estimate, warm-up
    assert m["first_call_s"] >= 0 and m["timer"] == "wall"


def test_time_stages_and_predictor():
    order = []
    launchers = [("a", lambda: order.append("a")), ("b", lambda: order.append("b"))]
    stages = timing.time_stages(launchers, timing.WallTimer(), reps=3)
    assert [s["name"] for s in stages] == ["a", "b"] and all(s["runs"] == 3 for s in stages)
    assert order == ["a", "b"] * 4
    p = timing.Predictor()
    small, big = common.parse_size("1x1024x128x4"), common.parse_size("1x2048x128x4")
    assert p.predict_ms("x", big) is None
    p.observe("x", small, 10.0)
    assert 70 < p.predict_ms("x", big) < 80  # ~7x the FLOPs
    assert timing.over_budget(None, 10, 3) is None
    assert timing.over_budget(1000.0, 10, 3) is None
    assert "per-system budget" in timing.over_budget(5000.0, 10, 3)


# -- report ----------------------------------------------------------------------------------

def fake_results():
    sizes = ["2x128x64x4", "1x256x128x4", "1x1024x128x4", "1x2048x128x4"]
    systems = {
        "ours_fp32": {"label": "ours (fp32)", "kind": "ours", "available": True,
                      "classes": ["fp32", "fp32"], "precision": "fp32"},
        "ref_eager": {"label": "reference eager fp32", "kind": "torch", "available": True,
                      "classes": ["fp32", "fp32"]},
        "cueq_bf16": {"label": "cuEquivariance bf16", "kind": "peer", "available": True,
                      "classes": ["bf16", "fp32"]},
        "trifast_fp32": {"label": "trifast fp32", "kind": "peer", "available": False,
                         "why_absent": "not importable (ModuleNotFoundError)"},
    }
    runs = []
    for i, sz in enumerate(sizes):
        s = common.parse_size(sz)
        base = dict(size=sz, B=s.B, N=s.N, D=s.D, h=s.h)
        t = roofline.forward_flops(s.B, s.N, s.D, s.h) / 30e12 * 1e3
        runs.append(dict(base, system="ours_fp32", status="ok", ms=t, ms_min=t * .98,
                         ms_max=t * 1.05, runs=10, first_call_s=0.5, peak_GiB=0.1 * (i + 1)))
        if sz == "1x2048x128x4":
            runs.append(dict(base, system="ref_eager", status="oom",
                             error="OutOfMemoryError: CUDA out of memory"))
            runs.append(dict(base, system="cueq_bf16", status="skipped",
                             note="suite time budget"))
        else:
            runs.append(dict(base, system="ref_eager", status="ok", ms=3 * t, ms_min=3 * t,
                             ms_max=3 * t, runs=5, first_call_s=0.1, peak_GiB=2.0 * (i + 1)))
            runs.append(dict(base, system="cueq_bf16", status="ok", ms=0.5 * t,
                             ms_min=0.5 * t, ms_max=0.6 * t, runs=5, first_call_s=3,
                             peak_GiB=0.5))
    stages = [{"system": "ours_fp32", "size": sz, "forward_ms": 1.0, "sum_ms": 0.9,
               "stages": [{"name": "mask", "ms": 0.1, "share": 0.1 / 0.9},
                          {"name": "attention", "ms": 0.8, "share": 0.8 / 0.9}]}
              for sz in sizes[:2]]
    stages.append({"system": "ours_fp32", "size": sizes[2], "error": "RuntimeError: boom"})
    accuracy = [
        {"system": "ours_fp32", "size": "1x64x128x4", "rel_l2": 2.6e-7, "tolerance": 1e-5,
         "ok": True},
        {"system": "cueq_bf16", "size": "1x64x128x4", "rel_l2": 1.7e-3, "tolerance": 2e-2,
         "ok": True},
        {"system": "ref_eager", "size": "1x64x128x4", "rel_l2": math.inf, "nonfinite": 3,
         "tolerance": 1e-5, "ok": False},
        {"system": "spec_float64", "size": "1x64x128x4", "rel_l2": 3e-16, "tolerance": 1e-10,
         "ok": True},
        {"system": "trifast_fp32", "size": "2x75x64x4", "error": "boom | pipe", "ok": False},
    ]
    ceilings = {"copy_GBps": 4300.0, "fp32_TFLOPs": 50.0, "tf32_TFLOPs": 400.0,
                "bf16_TFLOPs": 780.0, "assumed": [], "errors": {"cupy_tf32": "x"},
                "by_source": {"cupy": {"copy_GBps": 4300.0, "fp32_TFLOPs": 50.0},
                              "torch": {"bf16_TFLOPs": 780.0}}}
    meta = {"gpu": "NVIDIA H200", "date_utc": "2026-12-01T00:00:00+00:00", "wall_s": 400,
            "git_commit": "0123456789abcdef", "argv": ["benchmarks/run.py"],
            "torch_cuda": {"memory_GiB": 139.8, "sms": 132}, "versions": {"torch": "2.11"},
            "phases": {"ours_s": 60}}
    return {"schema": 1, "meta": meta, "ceilings": ceilings, "systems": systems,
            "accuracy": accuracy, "runs": runs, "stages": stages, "notes": ["a note"]}


def test_report_from_fake_results(tmp_path):
    data = fake_results()
    written = report.write_all(data, tmp_path, plots=False)
    md = (tmp_path / "results.md").read_text()
    assert set(written) == {"results.md", "results.json"}
    assert "| size BxNxDxh | ours (fp32) | reference eager fp32 | cuEquivariance bf16 |" in md
    assert "OOM" in md and "skip" in md and "suite time budget" in md
    # ours in fp32 against its split products' ceiling: a third of bf16's
    assert "ours (fp32) against the roofline" in md and "of fp32x3 ceiling" in md
    assert "attention" in md and "stages of ours_fp32 at 1x1024x128x4: RuntimeError" in md
    assert "2.60e-07 ok" in md and "inf FAIL, 3 non-finite" in md and "boom | pipe" in md
    assert "not importable" in md  # absent system and its reason
    saved = json.loads((tmp_path / "results.json").read_text())
    ok = [r for r in saved["runs"] if r["system"] == "ours_fp32"]
    assert all(r["TFLOPs"] == pytest.approx(30, rel=1e-6) for r in ok)
    assert all(r["of_compute_ceiling"] == pytest.approx(30 / (780 / 3), rel=1e-6) for r in ok)
    bf = next(r for r in saved["runs"] if r["system"] == "cueq_bf16" and r["status"] == "ok")
    assert bf["classes"] == ["bf16", "fp32"]
    text = report.summary_text(saved)
    lines = text.splitlines()
    assert lines[1].split()[:4] == ["size", "ours_fp32", "ref", "cueq_bf16"]
    assert any(line.startswith("1x2048x128x4") and "OOM" in line and "skip" in line
               for line in lines)
    assert "accuracy at 1x64x128x4" in text and "ref inf FAIL" in text
    assert "ours_fp32 2.60e-07" in text
    assert "absent: trifast_fp32" in text and "copy 4300 GB/s" in text
    # rebuilding from the saved JSON works and changes nothing
    assert report.main([str(tmp_path / "results.json"), "--no-plots"]) == 0
    assert (tmp_path / "results.md").read_text() == md


def test_report_plots(tmp_path):
    pytest.importorskip("matplotlib")
    written = report.write_all(fake_results(), tmp_path, plots=True)
    for name in ("time_vs_n.png", "memory_vs_n.png"):
        assert name in written
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- systems ---------------------------------------------------------------------------------

def test_trifast_tuning_reuse(monkeypatch):
    from benchmarks import systems
    tuned = object()
    fwd = types.SimpleNamespace(cache={
        (4, 32, 1024, "torch.float32", "torch.bool"): object(),
        (4, 32, 2048, "torch.float32", "torch.bool"): tuned,
        (4, 16, 128, "torch.bfloat16", "torch.float32", "torch.bool"): object()})
    pkg = types.ModuleType("trifast")
    mod = types.ModuleType("trifast.triton")
    mod._fwd = fwd
    monkeypatch.setitem(sys.modules, "trifast", pkg)
    monkeypatch.setitem(sys.modules, "trifast.triton", mod)
    assert systems.trifast_tuning(2000, 4, 32, "float32", 2048) == (None, None)
    note, skip = systems.trifast_tuning(4096, 4, 32, "float32", 2048)
    assert skip is None and "CLOSEST_N=2048" in note
    assert fwd.cache[(4, 32, 4096, "torch.float32", "torch.bool")] is tuned
    note, skip = systems.trifast_tuning(4096, 4, 32, "bfloat16", 2048)  # tuned for d=16 only
    assert note is None and "autotune" in skip
    assert not any(k[:3] == (4, 32, 4096) and "torch.bfloat16" in k for k in fwd.cache)
    # a bf16 key (which holds float32 tensors too) does not pass for a float32 run
    fwd.cache = {(4, 32, 2048, "torch.bfloat16", "torch.float32", "torch.bool"): tuned}
    assert "autotune" in systems.trifast_tuning(4096, 4, 32, "float32", 2048)[1]
    assert systems.trifast_tuning(4096, 4, 32, "bfloat16", 2048)[1] is None


# -- the worker that times ours, on a NumPy stand-in for CuPy --------------------------------

def fake_cupy():
    """Just what benchmarks/ours.py touches, on NumPy, with a counting memory pool."""
    cp = types.ModuleType("cupy")
    cp.__version__ = "0-fake"
    cp.float32, cp.nan = np.float32, np.nan

    class Pool:
        used = 0
        total = 0

        def used_bytes(self):
            return self.used

        def total_bytes(self):
            return self.total

        def free_all_blocks(self):
            self.total = self.used

        def malloc(self, size):
            self.used += size
            self.total = max(self.total, self.used)
            return size

    pool = Pool()
    state = {"allocator": pool.malloc}

    def alloc_like(a):
        state["allocator"](np.asarray(a).nbytes)  # goes through the current allocator
        return np.array(a, np.float32)

    cp.get_default_memory_pool = lambda: pool
    cp.get_default_pinned_memory_pool = lambda: types.SimpleNamespace(
        free_all_blocks=lambda: None)
    cp.asarray = alloc_like
    cp.empty = lambda shape, dtype=None: alloc_like(np.empty(shape, dtype))
    cp.asnumpy = np.asarray
    cp.full = lambda shape, v, dtype=None: alloc_like(np.full(shape, v, dtype))

    class RandomState:
        def __init__(self, seed):
            self.rng = np.random.default_rng(seed)

        def standard_normal(self, shape, dtype=np.float64):
            return alloc_like(self.rng.standard_normal(shape).astype(dtype))

    cp.random = types.SimpleNamespace(RandomState=RandomState)

    class Event:
        def record(self, stream=None):
            import time
            self.t = time.perf_counter()

    cp.cuda = types.SimpleNamespace(
        is_available=lambda: True,
        Device=lambda *a: types.SimpleNamespace(synchronize=lambda: None,
                                               compute_capability="90"),
        Event=Event,
        get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
        get_allocator=lambda: state["allocator"],
        set_allocator=lambda f: state.__setitem__("allocator", f),
        runtime=types.SimpleNamespace(memGetInfo=lambda: (10 ** 12 - pool.total, 10 ** 12)))
    return cp, pool


def fake_package(cp):
    """triattn_cupy with a TriangleAttention that takes `precision` per call only."""
    import triattn_cupy
    from triattn_cupy import reference
    tc = types.ModuleType("triattn_cupy")
    tc.__version__ = "fake"
    tc.reference = reference
    tc.random_weights = triattn_cupy.random_weights
    tc.PRECISIONS = ("fp32", "bf16")

    class TriangleAttention:
        def __init__(self, weights, *, device=None):
            self.weights = weights

        def __call__(self, pair, mask=None, *, precision="fp32", out=None):
            res = reference.triangle_attention(pair, mask, self.weights, dtype=np.float32)
            if precision == "bf16":
                res = res + 1e-3 * np.abs(res).mean()  # a visible, bounded error
            cp.full(res.shape, 0, np.float32)  # scratch through the allocator
            if out is None:
                return cp.asarray(res)
            out[...] = res
            return out

        def stage_launchers(self, pair, mask=None, *, precision="fp32", out=None):
            return [("project", lambda: None),
                    ("attention", lambda: self(pair, mask, precision=precision))]

    tc.TriangleAttention = TriangleAttention
    return tc


def test_ours_worker_on_a_fake_cupy(monkeypatch):
    pytest.importorskip("triattn_cupy")
    from benchmarks import ours
    cp, pool = fake_cupy()
    tc = fake_package(cp)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "triattn_cupy", tc)
    args = bench_run.parse_args(["--sizes", "1x8x16x4,1x12x16x4", "--acc-sizes", "1x6x16x4",
                                 "--target-s", "0.001", "--max-reps", "3",
                                 "--stage-reps", "3"])
    rec = common.Recorder()
    ours.run_ours(args, rec, deadline=float("inf"))
    data = rec.data
    assert set(data["systems"]) == {"ours_fp32", "ours_bf16"}
    acc = {a["system"]: a for a in data["accuracy"]}
    assert acc["ours_fp32"]["ok"] and acc["ours_fp32"]["rel_l2"] < 1e-6
    assert not acc["ours_bf16"]["ok"] or acc["ours_bf16"]["rel_l2"] > 1e-4
    runs = data["runs"]
    assert len(runs) == 4 and all(r["status"] == "ok" for r in runs), runs
    assert all(r["peak_GiB"] > 0 and r["alloc_calls_first_call"] > 0 for r in runs)
    assert [st["system"] for st in data["stages"]] == ["ours_fp32", "ours_bf16"] * 2
    assert all([x["name"] for x in st["stages"]] == ["project", "attention"]
               for st in data["stages"])
    assert data["meta"]["ours_env"]["precisions"] == ["fp32", "bf16"]
    assert sys.modules["cupy"].cuda.get_allocator() == pool.malloc  # allocator restored


# -- a dry run of the whole pipeline on the CPU ----------------------------------------------

def test_cpu_dry_run(tmp_path, capsys):
    pytest.importorskip("torch")
    if find_spec_file() is None:  # the PyTorch systems are built from the spec
        pytest.skip("spec reference_module.py not found; looked at "
                    + " and ".join(str(p) for p in SPEC_CANDIDATES))
    out = tmp_path / "out"
    rc = bench_run.main(["--device", "cpu", "--sizes", "1x8x16x4,1x10x16x4",
                         "--acc-sizes", "1x6x16x4", "--systems", "ours,ref_eager,sdpa,cueq",
                         "--target-s", "0.001", "--max-reps", "3", "--no-plots",
                         "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    ok = {(r["system"], r["size"]) for r in data["runs"] if r["status"] == "ok"}
    assert ok == {(s, z) for s in ("ref_eager", "sdpa") for z in ("1x8x16x4", "1x10x16x4")}
    acc = {a["system"]: a for a in data["accuracy"]}
    assert acc["ref_eager"]["ok"] and acc["sdpa"]["ok"]
    assert acc["spec_float64"]["rel_l2"] < 1e-12  # weights loaded into the spec correctly
    assert not data["systems"]["cueq_fp32"]["available"]
    assert "ours_fp32" in data["systems"] or any("ours" in n for n in data["notes"])
    assert (out / "results.md").is_file() and (out / "run.log").is_file()
    printed = capsys.readouterr().out
    assert "ms per forward" in printed and "total" in printed


def test_a_dead_ours_worker_is_recorded(monkeypatch):
    false = pathlib.Path("/bin/false")
    if not false.exists():
        pytest.skip("no /bin/false")
    common.setup_logging()
    monkeypatch.setattr(sys, "executable", str(false))  # the child exits 1 at once
    args = bench_run.parse_args(["--sizes", "1x8x16x4"])
    rec = common.Recorder()
    bench_run.ours_phase(args, [], rec, deadline=float("inf"), log_path=None)
    assert any("exited with 1" in n for n in rec.data["notes"])
    assert rec.data["systems"]["ours_fp32"]["available"] is False

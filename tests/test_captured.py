"""Captured forwards (TriangleAttention.capture, gpu/captured.py): a replay gives the bits of
the call with the same arguments, after the inputs change in place or are copied in, with
and without a mask, at both nodes and both mask layouts, in row blocks, on another stream,
into a given `out` and in place; bad replay arguments are ValueErrors naming them.

Every output compared starts as NaN (the given `out`, or graph.out poisoned before a
replay), and `_assert_same_bits` also asks for finite outputs: equal NaN bits never pass.
CPU tests: the error without a GPU or with a CuPy before the graph API, the replay
arguments' check, the arena's reuse of blocks, and capture's keywords being the call's.
"""
from __future__ import annotations

import inspect
import types

import numpy as np
import pytest

import triattn_cupy as ta
from triattn_cupy import cuda_setup, reference
from triattn_cupy.gpu import captured
from helpers import rel_l2

gpu = pytest.mark.gpu
TOLERANCE = {"fp32": 1e-5, "tf32": 1e-3, "bf16": 5e-3}  # rel L2 against float64 (test_gpu)


# ---- CPU ----

@pytest.mark.skipif(ta.gpu_available(), reason="checks the error without a GPU")
def test_capture_without_gpu_raises_the_modules_error():
    pytest.importorskip("cupy")
    module = object.__new__(ta.TriangleAttention)  # (its constructor raises the same error)
    with pytest.raises(cuda_setup.GpuUnavailableError,
                       match="triattn_cupy.reference.triangle_attention"):
        module.capture(None)


def test_a_cupy_without_the_graph_api_names_the_version_needed():
    old = types.SimpleNamespace(__version__="9.6.0",
                                cuda=types.SimpleNamespace(Stream=type("Stream", (), {})))
    with pytest.raises(RuntimeError, match=r"needs CuPy 11 or newer "
                                           r"\(cupy.cuda.Stream.begin_capture\); this CuPy "
                                           r"is 9.6.0"):
        captured.check_graph_api(old)
    new = types.SimpleNamespace(__version__="14.0.0", cuda=types.SimpleNamespace(
        Stream=type("Stream", (), {"begin_capture": None, "end_capture": None})))
    captured.check_graph_api(new)


def test_replay_arguments_must_match_the_static_arrays():
    static = np.zeros((2, 5, 5, 8), np.float32)
    captured.check_like("pair", static, np.ones_like(static))
    with pytest.raises(ValueError, match=r"pair must have the captured pair's shape "
                                         r"\(2, 5, 5, 8\) and dtype float32; got shape "
                                         r"\(2, 5, 6, 8\) and dtype float32"):
        captured.check_like("pair", static, np.zeros((2, 5, 6, 8), np.float32))
    with pytest.raises(ValueError, match=r"mask must have the captured mask's shape "
                                         r"\(2, 5, 5\) and dtype bool; got shape \(2, 5, 5\) "
                                         r"and dtype int32"):
        captured.check_like("mask", np.zeros((2, 5, 5), bool), np.zeros((2, 5, 5), np.int32))


def test_the_arena_hands_back_its_blocks_in_order():
    class Memory:
        def __init__(self, size):
            self.size, self.ptr = size, 256 * (len(made) + 1)
            made.append(self)

    made = []
    arena = captured._Arena(types.SimpleNamespace(cuda=types.SimpleNamespace(Memory=Memory)))
    first = [arena(1000), arena(50), arena(300)]
    arena.rewind()
    assert [arena(1000), arena(50), arena(300)] == first and len(made) == 3
    arena.rewind()
    assert arena(900) is first[0]   # a smaller request takes the block in its place
    bigger = arena(60)              # a larger one a new block, kept with the others
    assert all(bigger is not block for block in first)
    assert len(made) == 4 and arena.nbytes == 1000 + 60 + 50 + 300


def test_capture_takes_the_calls_keywords():
    def keywords(function):
        return {name for name, p in inspect.signature(function).parameters.items()
                if p.kind is p.KEYWORD_ONLY}

    assert keywords(ta.TriangleAttention.capture) == keywords(ta.TriangleAttention.__call__)


class _Pointer(np.ndarray):
    """A NumPy array with CuPy's `.data.ptr` (its own address)."""
    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


def _fake_capture(monkeypatch, choose_rows, scratch_bytes=1 << 10, changed=False):
    """CapturedForward over a stand-in CuPy and Forward, recording what happens in order:
    `choose_rows(row_block, max_scratch_bytes)` is the stand-in Forward's row blocks."""
    events, made = [], []
    plan = types.SimpleNamespace(scratch_bytes=scratch_bytes, M=3 * 3,
                                 route=types.SimpleNamespace(name="fake"))

    class Stream:
        def __init__(self, non_blocking=False):
            assert non_blocking

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def record(self):
            return "caller's work"

        def wait_event(self, event):
            events.append(("wait", event))

        def synchronize(self):
            events.append("synchronize")

        def begin_capture(self):
            events.append("begin_capture")

        def end_capture(self):
            events.append("end_capture")
            return types.SimpleNamespace(launch=lambda stream: events.append(("launch", stream)))

    class Memory:
        def __init__(self, size):
            self.size, self.ptr = size, 4096 * (len(made) + 1)
            made.append(self)

    caller = Stream(non_blocking=True)
    cuda = types.SimpleNamespace(Stream=Stream, Memory=Memory, Device=lambda d: Stream(True),
                                 get_current_stream=lambda: caller,
                                 runtime=types.SimpleNamespace(getDevice=lambda: 0))
    out_array = np.zeros(4, np.float32).view(_Pointer)

    class Forward:
        def __init__(self, dw, pair, mask, fully_masked, out, precision, **options):
            self.options = options
            events.append(("Forward", options["row_block"], options["max_scratch_bytes"]))
            self.plan = (types.SimpleNamespace(**vars(plan)) if changed and made
                         else plan)
            self.rows_per_block = choose_rows(options["row_block"],
                                              options["max_scratch_bytes"])
            options["allocate"](1000), options["allocate"](16)  # scratch, out

        def run(self):  # (the capture's forward: its dependents as programmatic launches)
            events.append("run, dependents" if captured.dependent_launch.active() else "run")
            return out_array

    monkeypatch.setattr(captured, "_cupy", lambda: types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(captured, "check_graph_api", lambda cupy: None)
    monkeypatch.setattr(captured, "Forward", Forward)
    monkeypatch.setattr(captured, "_device_view", lambda obj, name, device: (obj, False))
    monkeypatch.setattr(captured.dependent_launch, "supported", lambda cc: cc >= 90)
    module = types.SimpleNamespace(device=0, _dw=types.SimpleNamespace(compute_capability=90),
                                   _conventions=lambda layout, node: ("pair", "starting"))
    return module, events, made, caller


def test_capture_pins_the_warm_ups_row_blocks_and_reuses_its_memory(monkeypatch):
    module, events, made, caller = _fake_capture(
        monkeypatch, lambda row_block, limit: row_block or (7 if limit else None))
    pair = np.zeros((1, 3, 3, 4), np.float32)
    graph = captured.CapturedForward(module, pair, None, None, dict(max_scratch_bytes=500))
    assert events == [("wait", "caller's work"), ("Forward", None, 500), "run", "synchronize",
                      "begin_capture", ("Forward", 7, None), "run, dependents", "end_capture"]
    assert len(made) == 2 and graph.memory_bytes == 1016 and graph.rows_per_block == 7
    events.clear()
    pair2 = np.ones_like(pair)
    assert graph(pair2) is graph.out
    assert np.array_equal(graph.pair, pair2) and graph.pair is pair
    assert events == [("launch", caller)]
    with pytest.raises(ValueError, match="mask: this forward was captured without a mask"):
        graph(pair2 * 2, np.ones((1, 3, 3), bool))
    assert np.array_equal(pair, pair2)  # nothing copied before the error


def test_capture_pins_the_single_pass_where_the_free_memory_chose_it(monkeypatch):
    big = captured.row_blocks.SCRATCH_FLOOR_BYTES + 1
    module, events, _, _ = _fake_capture(monkeypatch, lambda row_block, limit: None,
                                         scratch_bytes=big)
    captured.CapturedForward(module, np.zeros((3, 3, 4), np.float32), None, None, {})
    assert ("Forward", None, None) in events and ("Forward", None, big) in events


def test_a_forward_changed_under_capture_ends_the_capture(monkeypatch):
    module, events, _, _ = _fake_capture(monkeypatch, lambda row_block, limit: None,
                                         changed=True)
    with pytest.raises(RuntimeError, match="the forward changed between the warm-up and "
                                           "the capture"):
        captured.CapturedForward(module, np.zeros((3, 3, 4), np.float32), None, None, {})
    assert events[-1] == "end_capture" and events.count("run") == 1


# ---- GPU ----

@pytest.fixture
def cp():
    import cupy

    return cupy


def _problem(rng, B, N, D, h, masked=True):
    weights = ta.random_weights(D, h, seed=int(rng.integers(1 << 31)))
    pair = (rng.standard_normal((B, N, N, D)) * 2 + 0.5).astype(np.float32)
    mask = None
    if masked:
        mask = rng.random((B, N, N)) > 0.25
        mask[:, rng.integers(N), :] = False  # rows and columns without keys
        mask[:, :, rng.integers(N)] = False
    return ta.TriangleAttention(weights), pair, mask


def _new_values(rng, pair):
    return (rng.standard_normal(pair.shape) * 2 - 0.25).astype(pair.dtype)


def _host(array):
    return array.get() if hasattr(array, "get") else np.asarray(array)


def _assert_same_bits(got, expected, what):
    got, expected = _host(got), _host(expected)
    assert got.shape == expected.shape and got.dtype == expected.dtype, what
    assert np.isfinite(got.astype(np.float32)).all(), f"{what}: non-finite outputs"
    bits = np.dtype(f"u{got.dtype.itemsize}")
    differ = np.count_nonzero(got.view(bits) != expected.view(bits))
    assert differ == 0, f"{what}: {differ} of {got.size} outputs differ"


def _device(cp, host):
    """A host array on the device (bfloat16: CuPy's array of ml_dtypes.bfloat16 over its
    bits; CuPy runs no kernel on that type)."""
    if host.dtype.name == "bfloat16":
        return cp.asarray(host.view(np.uint16)).view(host.dtype)
    return cp.asarray(host)


def _poison(cp, array):
    """`array` filled with NaN (as its bits), so that a forward must write all of it."""
    if array.dtype.itemsize == 4:
        array.fill(np.nan)
    else:  # float16 or bfloat16: the quiet NaN of each
        array.view(cp.uint16).fill(0x7FC0 if array.dtype.name == "bfloat16" else 0x7E00)


def _call(cp, module, pair, mask, **options):
    """module(pair, mask, **options) into a NaN-filled `out`."""
    out = cp.empty(pair.shape, f"u{pair.dtype.itemsize}").view(pair.dtype)
    _poison(cp, out)
    got = module(pair, mask, out=out, **options)
    assert got is out
    return got


@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("B,N,D,h", [(2, 37, 32, 4), (1, 130, 64, 4)])
def test_replay_gives_the_calls_bits(cp, rng, precision, B, N, D, h):
    """The capture's own forward, then replays after the pair and mask change in place."""
    module, pair, mask = _problem(rng, B, N, D, h)
    d_pair, d_mask = cp.asarray(pair), cp.asarray(mask)
    graph = module.capture(d_pair, d_mask, precision=precision)
    assert graph.pair is d_pair and graph.mask is d_mask
    expected = _call(cp, module, d_pair, d_mask, precision=precision)
    _assert_same_bits(graph.out, expected, "the warm-up's result in graph.out")
    for step in range(2):
        pair = _new_values(rng, pair)
        d_pair[...] = cp.asarray(pair)
        d_mask[...] = cp.asarray(rng.random(mask.shape) > 0.4)
        _poison(cp, graph.out)
        got = graph()
        assert got is graph.out
        expected = _call(cp, module, d_pair, d_mask, precision=precision)
        _assert_same_bits(got, expected, f"replay {step} {precision}")
    reference_out = reference.triangle_attention(pair, d_mask.get(), module.weights,
                                                 fully_masked="zero")
    assert rel_l2(got, reference_out) <= TOLERANCE[precision]


@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("B,N,D,h", [(2, 128, 64, 4), (1, 200, 128, 4), (1, 260, 128, 4)])
def test_programmatic_dependents_give_the_calls_bits(cp, rng, monkeypatch, precision,
                                                     B, N, D, h):
    """On compute capability 9.0 (with a driver that captures them) a small captured
    forward's attention and out projection go out as programmatic dependents
    (gpu/dependent_launch.py: the mma.sync route with 128-row out blocks, the wgmma route),
    a larger one's (1x260: past MAX_ROWS) as a call's; the replays give the calls' bits."""
    from triattn_cupy.gpu import dependent_launch

    module, pair, mask = _problem(rng, B, N, D, h)
    sent = []
    launch = dependent_launch.launch
    monkeypatch.setattr(dependent_launch, "launch", lambda *a: (sent.append(a[0]), launch(*a)))
    d_pair, d_mask = cp.asarray(pair), cp.asarray(mask)
    graph = module.capture(d_pair, d_mask, precision=precision)
    expected = (dependent_launch.supported(module._dw.compute_capability)
                and B * N * N <= dependent_launch.MAX_ROWS)
    assert len(sent) == (2 if expected else 0)
    for step in range(2):
        _poison(cp, graph.out)
        _assert_same_bits(graph(), _call(cp, module, d_pair, d_mask, precision=precision),
                          f"replay {step} {precision}")
        d_pair[...] = cp.asarray(_new_values(rng, pair))


@gpu
def test_replays_repeat_the_same_bits(cp, rng):
    module, pair, mask = _problem(rng, 2, 37, 32, 4)
    graph = module.capture(cp.asarray(pair), cp.asarray(mask), precision="bf16")
    first = graph().copy()
    assert graph.memory_bytes >= graph.out.nbytes
    for _ in range(3):
        _poison(cp, graph.out)
        _assert_same_bits(graph(), first, "a second replay")


@gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_new_inputs_copied_in(cp, rng, precision):
    module, pair, mask = _problem(rng, 2, 37, 32, 4)
    graph = module.capture(cp.asarray(pair), cp.asarray(mask), precision=precision)
    pair2 = cp.asarray(_new_values(rng, pair))
    mask2 = cp.asarray(rng.random(mask.shape) > 0.5)
    _poison(cp, graph.out)
    got = graph(pair2, mask2)
    _assert_same_bits(got, _call(cp, module, pair2, mask2, precision=precision), "copied in")
    assert cp.array_equal(graph.pair, pair2) and cp.array_equal(graph.mask, mask2)
    pair3 = cp.asarray(_new_values(rng, pair))  # the pair alone: the mask stays mask2
    _poison(cp, graph.out)
    _assert_same_bits(graph(pair3), _call(cp, module, pair3, mask2, precision=precision),
                      "the pair alone copied in")


@gpu
def test_bad_replay_arguments_name_the_argument(cp, rng):
    module, pair, mask = _problem(rng, 2, 37, 32, 4)
    graph = module.capture(cp.asarray(pair), cp.asarray(mask))
    with pytest.raises(ValueError, match=r"pair must have the captured pair's shape "
                                         r"\(2, 37, 37, 32\) and dtype float32; got shape "
                                         r"\(1, 37, 37, 32\)"):
        graph(cp.zeros((1, 37, 37, 32), np.float32))
    with pytest.raises(ValueError, match=r"pair must have .* dtype float32; got .* float16"):
        graph(cp.zeros(pair.shape, np.float16))
    with pytest.raises(ValueError, match=r"mask must have the captured mask's shape "
                                         r"\(2, 37, 37\) and dtype bool; got .* int32"):
        graph(None, cp.ones(mask.shape, np.int32))
    with pytest.raises(TypeError, match="pair is a NumPy \\(host\\) array"):
        graph(pair)


@gpu
def test_unmasked(cp, rng):
    module, pair, _ = _problem(rng, 2, 37, 32, 4, masked=False)
    d_pair = cp.asarray(pair)
    graph = module.capture(d_pair, None, precision="tf32")
    assert graph.mask is None
    d_pair[...] = cp.asarray(_new_values(rng, pair))
    _poison(cp, graph.out)
    _assert_same_bits(graph(), _call(cp, module, d_pair, None, precision="tf32"), "no mask")
    with pytest.raises(ValueError, match="mask: this forward was captured without a mask"):
        graph(d_pair, cp.ones((2, 37, 37), bool))


@gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("models_shape", [False, True])
def test_ending_node_with_a_row_mask(cp, rng, precision, models_shape):
    """node "ending" (the transposed pair and mask read in place) and mask_layout "row",
    the mask also in the models' (B, N, 1, 1, N) shape."""
    module, pair, mask = _problem(rng, 2, 37, 32, 4)
    options = dict(precision=precision, node="ending", mask_layout="row")
    d_pair = cp.asarray(pair)
    d_mask = cp.asarray(mask[:, :, None, None, :] if models_shape else mask)
    graph = module.capture(d_pair, d_mask, **options)
    d_pair[...] = cp.asarray(_new_values(rng, pair))
    _poison(cp, graph.out)
    _assert_same_bits(graph(), _call(cp, module, d_pair, d_mask, **options),
                      f"ending/row {precision}")


@gpu
@pytest.mark.parametrize("R", [1, 7, 37, 10 ** 6])
def test_forced_row_blocks(cp, rng, R):
    """row_block=R: R = 1, R not dividing B N, R = N (a batch per block), every row."""
    module, pair, mask = _problem(rng, 2, 37, 32, 4)
    d_pair, d_mask = cp.asarray(pair), cp.asarray(mask)
    graph = module.capture(d_pair, d_mask, precision="tf32", row_block=R)
    assert graph.rows_per_block == min(R, 2 * 37)
    d_pair[...] = cp.asarray(_new_values(rng, pair))
    _poison(cp, graph.out)
    _assert_same_bits(graph(), _call(cp, module, d_pair, d_mask, precision="tf32",
                                     row_block=R), f"row_block={R}")


@gpu
def test_a_scratch_limit_chooses_the_calls_row_blocks(cp, rng):
    module, pair, mask = _problem(rng, 1, 130, 64, 4)
    d_pair, d_mask = cp.asarray(pair), cp.asarray(mask)
    limit = pair.nbytes // 2
    graph = module.capture(d_pair, d_mask, precision="fp32", max_scratch_bytes=limit)
    assert graph.rows_per_block is not None
    d_pair[...] = cp.asarray(_new_values(rng, pair))
    _poison(cp, graph.out)
    _assert_same_bits(graph(), _call(cp, module, d_pair, d_mask, precision="fp32",
                                     max_scratch_bytes=limit), "max_scratch_bytes")


@gpu
def test_replay_on_another_stream(cp, rng):
    module, pair, mask = _problem(rng, 2, 37, 32, 4)
    d_pair, d_mask = cp.asarray(pair), cp.asarray(mask)
    graph = module.capture(d_pair, d_mask, precision="bf16")
    pair2 = cp.asarray(_new_values(rng, pair))
    expected = _call(cp, module, pair2, d_mask, precision="bf16")
    cp.cuda.get_current_stream().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        _poison(cp, graph.out)
        got = graph(pair2)  # the copy and the replay ordered on this stream
    stream.synchronize()
    _assert_same_bits(got, expected, "replayed on a non-blocking stream")


@gpu
def test_out_given(cp, rng):
    module, pair, mask = _problem(rng, 2, 37, 32, 4)
    d_pair, d_mask = cp.asarray(pair), cp.asarray(mask)
    out = cp.full(pair.shape, np.nan, np.float32)
    graph = module.capture(d_pair, d_mask, out=out, precision="fp32")
    assert graph.out is out
    _assert_same_bits(out, _call(cp, module, d_pair, d_mask), "the warm-up into out")
    d_pair[...] = cp.asarray(_new_values(rng, pair))
    out.fill(np.nan)
    assert graph() is out
    _assert_same_bits(out, _call(cp, module, d_pair, d_mask), "a replay into out")


@gpu
@pytest.mark.parametrize("R", [None, 5])
def test_in_place(cp, rng, R):
    """out = pair: the capture's forward overwrites the pair, as the call does; a replay
    after the pair is copied in again gives the call's bits."""
    module, pair, mask = _problem(rng, 2, 37, 32, 4)
    d_mask = cp.asarray(mask)
    expected = _call(cp, module, cp.asarray(pair), d_mask, precision="bf16", row_block=R)
    d_pair = cp.asarray(pair)
    graph = module.capture(d_pair, d_mask, out=d_pair, precision="bf16", row_block=R)
    assert graph.out is d_pair
    _assert_same_bits(d_pair, expected, "the warm-up in place")
    d_pair.fill(np.nan)
    _assert_same_bits(graph(cp.asarray(pair)), expected, f"a replay in place R={R}")


@gpu
def test_a_strided_pair_is_copied_at_every_replay(cp, rng):
    """A pair whose rows are not contiguous is read from an aligned copy that the graph
    makes again at every replay from the static (strided) pair."""
    module, pair, mask = _problem(rng, 2, 37, 32, 4)
    wide = cp.zeros(pair.shape[:-1] + (36,), np.float32)
    d_pair, d_mask = wide[..., 1:33], cp.asarray(mask)  # rows 4 bytes past 16-byte ones
    d_pair[...] = cp.asarray(pair)
    graph = module.capture(d_pair, d_mask, precision="tf32")
    d_pair[...] = cp.asarray(_new_values(rng, pair))
    _poison(cp, graph.out)
    _assert_same_bits(graph(), _call(cp, module, d_pair, d_mask, precision="tf32"),
                      "strided pair")


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_pairs(cp, rng, dtype):
    host = (pytest.importorskip("ml_dtypes").bfloat16 if dtype == "bfloat16"
            else np.float16)
    module, pair, mask = _problem(rng, 2, 37, 32, 4)
    d_pair, d_mask = _device(cp, pair.astype(host)), cp.asarray(mask)
    graph = module.capture(d_pair, d_mask, precision="bf16")
    assert graph.out.dtype == d_pair.dtype
    pair2 = _device(cp, _new_values(rng, pair).astype(host))
    _poison(cp, graph.out)
    _assert_same_bits(graph(pair2), _call(cp, module, pair2, d_mask, precision="bf16"),
                      dtype)


@gpu
def test_nan_at_fully_masked_queries(cp, rng):
    """fully_masked="nan": NaN exactly where the call has NaN, the same bits elsewhere."""
    module, pair, mask = _problem(rng, 2, 37, 32, 4)
    d_pair, d_mask = cp.asarray(pair), cp.asarray(mask)
    graph = module.capture(d_pair, d_mask, fully_masked="nan")
    d_pair[...] = cp.asarray(_new_values(rng, pair))
    graph.out.fill(0)  # (zeros: the NaN must come from the replay)
    got = graph().get()
    expected = _call(cp, module, d_pair, d_mask, fully_masked="nan").get()
    nan = np.isnan(expected)
    assert nan.any() and not nan.all()
    assert np.array_equal(np.isnan(got), nan)
    _assert_same_bits(got[~nan], expected[~nan], "outside the fully-masked queries")

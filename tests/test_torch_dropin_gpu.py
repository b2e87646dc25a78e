"""`triattn_cupy.torch` on the GPU, against the models' own forward in float64 (the block
cast to float64 on the GPU, fed the very values the kernels read).

Every pair dtype (float32, bfloat16, float16) x precision, both nodes, padding and random row
masks, B > 1, sizes that miss the tiles; a torch stream other than the default;
torch.compile(fullgraph=True); CUDA graph capture and replay. Compared where a row keeps at
least one key (elsewhere the models' -1e9 mask bias and `fully_masked` differ by design).
"""
from __future__ import annotations

import copy
import sys
import types
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _stand_in_for_scipy():
    """Boltz's layers import scipy.stats.truncnorm only to draw initial weights, which every
    test here redraws: where scipy is absent (a bare GPU host), a stand-in lets boltz-community
    import (``pip install --no-deps boltz-community==2.12.0 einops``)."""
    try:
        import scipy.stats  # noqa: F401
    except ImportError:
        scipy, stats = types.ModuleType("scipy"), types.ModuleType("scipy.stats")

        class truncnorm:  # noqa: N801  (scipy's name)
            def __getattr__(self, name):
                raise ImportError("scipy is not installed: Boltz's truncated-normal "
                                  "initialisation is unavailable")
        stats.truncnorm = truncnorm()
        scipy.stats = stats
        sys.modules.update({"scipy": scipy, "scipy.stats": stats})


_stand_in_for_scipy()
import model_blocks as mb  # noqa: E402  (needs torch)
from helpers import rel_l2  # noqa: E402
from test_gpu import TOLERANCE  # noqa: E402

import triattn_cupy.torch as tt  # noqa: E402
from triattn_cupy import import_weights  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA GPU visible to torch")]

D, C, H = 128, 32, 4  # Boltz's pairformer: c_z 128, c_hidden 32, 4 heads
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PRECISIONS = ("fp32", "tf32", "bf16")
# What rounding the output (and, for the stacks, each block's input) to the I/O dtype adds
IO_TOL = {torch.float32: 0.0, torch.float16: 1e-3, torch.bfloat16: 4e-3}


def tolerance(precision, dtype):
    return TOLERANCE[precision] + IO_TOL[dtype]


def block(starting=True, seed=0):
    return mb.randomize(mb.boltz_block(D, C, H, starting=starting), seed, scale=0.1) \
        .cuda().eval()


def row_mask(gen, B, N, kind):
    """(B, N, N) float32 0/1 row masks on the GPU: padding (each batch its own length),
    random (70% kept, one fully masked row) or open (70% kept, every row keeps keys: in a
    stack, a fully masked row's output, which differs by design, reaches other rows through
    the next blocks unless padding isolates it)."""
    if kind == "padding":
        lengths = [N - 3 * b - 1 for b in range(B)]
        kept = torch.zeros(B, N, dtype=torch.bool)
        for b, n in enumerate(lengths):
            kept[b, :n] = True
        keep = kept[:, :, None] & kept[:, None, :]
    else:
        keep = torch.rand(B, N, N, generator=gen) < 0.7
        keep[:, :, 0] = True  # every row keeps key 0, every column is kept by row 0
        keep[:, 0, :] = True
        if kind == "random":
            keep[0, 2, :] = False
    return keep.float().cuda()


def kept_rows(mask, starting, shape):
    keep = mask != 0
    rows = keep.any(-1)[:, :, None, None] if starting else keep.any(-2)[:, None, :, None]
    return rows.expand(shape).cpu().numpy()


def float64_forward(module, pair, mask, **kwargs):
    twin = copy.deepcopy(module)
    tt.restore(twin)
    with torch.no_grad():
        return twin.double()(pair.double(), mask.double(), **kwargs)


def check(got, want, mask, starting, tol):
    got, want = got.double(), want.double()
    rows = kept_rows(mask, starting, got.shape)
    err = rel_l2(got.cpu().numpy()[rows], want.cpu().numpy()[rows])
    assert err <= tol, f"rel L2 {err:.3g} > {tol:.3g}"


def pair_of(gen, B, N, dtype):
    return torch.randn(B, N, N, D, generator=gen).to(dtype).cuda()


# --- the functional form: every dtype x precision x node ------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("starting", [True, False], ids=["starting", "ending"])
def test_functional_form_against_the_block(dtype, precision, starting):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype} {precision} {starting}".encode()))
    module = block(starting)
    weights = import_weights(module)
    pair, mask = pair_of(gen, 2, 67, dtype), row_mask(gen, 2, 67, "random")
    out = tt.triangle_attention(pair, mask, weights, precision=precision)
    assert out.dtype == dtype and out.shape == pair.shape and out.device == pair.device
    check(out, float64_forward(module, pair, mask), mask, starting,
          tolerance(precision, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_pair_models_mask_shape_and_out(dtype):
    gen = torch.Generator().manual_seed(1)
    module = block(True)
    weights = import_weights(module)
    base = pair_of(gen, 2, 45, dtype)
    pair = base.transpose(1, 2)  # a strided view, read in place
    mask = row_mask(gen, 2, 45, "padding")
    out = torch.full_like(base, float("nan"))
    assert tt.triangle_attention(pair, mask[:, :, None, None, :], weights, out=out) is out
    check(out, float64_forward(module, pair, mask), mask, True, tolerance("fp32", dtype))


def test_bool_mask_and_no_mask():
    gen = torch.Generator().manual_seed(2)
    module = block(False)
    weights = import_weights(module)
    pair, mask = pair_of(gen, 1, 40, torch.float32), row_mask(gen, 1, 40, "random")
    got = tt.triangle_attention(pair, mask.bool(), weights)
    check(got, float64_forward(module, pair, mask), mask, False, TOLERANCE["fp32"])
    ones = torch.ones_like(mask)
    got = tt.triangle_attention(pair, None, weights)
    check(got, float64_forward(module, pair, ones), ones, False, TOLERANCE["fp32"])


# --- accelerate: a Boltz stack with residual adds --------------------------------------------

class Stack(torch.nn.Module):
    """2 starting + 2 ending Boltz blocks with residual adds, as its pairformer runs them."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            [block(s, seed) for seed, s in enumerate((True, False, True, False))])

    def forward(self, z, mask, chunk_size=None):
        for b in self.blocks:
            z = z + b(z, mask, chunk_size=chunk_size)
        return z


def stack_rows(mask, shape):
    """Positions whose row keeps a key at both nodes (a fully masked row's finite output
    differs by design, and a residual stack carries it on)."""
    return kept_rows(mask, True, shape) & kept_rows(mask, False, shape)


def stack_error(got, want, z, mask):
    """rel L2 of the stack's update (out - z) against want's, where rows keep keys (inf
    where want holds a NaN there)."""
    rows = stack_rows(mask, got.shape)
    z = z.double()
    got, want = (got.double() - z).cpu().numpy(), (want.double() - z).cpu().numpy()
    return rel_l2(got[rows], want[rows])


@pytest.fixture(scope="module")
def stack():
    return Stack()


@pytest.mark.parametrize("kind", ["padding", "open"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_accelerated_stack_fp32(stack, kind, precision):
    gen = torch.Generator().manual_seed(3)
    z, mask = pair_of(gen, 2, 97, torch.float32), row_mask(gen, 2, 97, kind)
    want = float64_forward(stack, z, mask)
    tt.accelerate(stack, precision=precision)
    try:
        with torch.inference_mode():
            got = stack(z, mask, chunk_size=32)
    finally:
        tt.restore(stack)
    assert got.dtype == torch.float32
    assert stack_error(got, want, z, mask) <= 2 * TOLERANCE[precision]


def test_stack_routed_by_class_runs_the_kernels(stack):
    """tt.accelerated (what triattn-run enables): the blocks' class routes them, every call
    goes through the kernels, none falls back."""
    gen = torch.Generator().manual_seed(4)
    z, mask = pair_of(gen, 2, 97, torch.float32), row_mask(gen, 2, 97, "padding")
    want = float64_forward(stack, z, mask)
    with tt.accelerated(precision="bf16"):
        with torch.inference_mode():
            got = stack(z, mask, chunk_size=32)
        report = tt.report(stack)
    assert (report.blocks, report.kernel_calls, report.fallbacks) == (4, 4, {})
    assert stack_error(got, want, z, mask) <= 2 * TOLERANCE["bf16"]


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_accelerated_stack_under_autocast(stack, autocast_dtype, precision):
    """The block's result in the autocast dtype, as the original's; the stack's residual
    stays float32. Within the original's own autocast error, or twice ours in fp32."""
    gen = torch.Generator().manual_seed(4)
    z, mask = pair_of(gen, 2, 80, torch.float32), row_mask(gen, 2, 80, "padding")
    want = float64_forward(stack, z, mask)
    with torch.no_grad(), torch.autocast("cuda", dtype=autocast_dtype):
        theirs = stack.blocks[0](z, mask)
        theirs_stack = stack(z, mask)
        tt.accelerate(stack, precision=precision)
        try:
            ours = stack.blocks[0](z, mask)
            ours_stack = stack(z, mask)
        finally:
            tt.restore(stack)
    assert ours.dtype == theirs.dtype == autocast_dtype
    assert ours_stack.dtype == theirs_stack.dtype
    theirs_error = stack_error(theirs_stack, want, z, mask)
    if not np.isfinite(theirs_error):  # fp16 autocast: their -1e9 overflows to -inf, and
        theirs_error = 0.0             # fully masked rows' NaN spreads through the stack
    bound = max(theirs_error, tolerance(precision, autocast_dtype))
    assert stack_error(ours_stack, want, z, mask) <= 2 * bound


def test_grad_enabled_runs_the_original(stack):
    gen = torch.Generator().manual_seed(5)
    z, mask = pair_of(gen, 1, 33, torch.float32), row_mask(gen, 1, 33, "padding")
    with torch.no_grad():
        want = stack(z, mask)
    tt.accelerate(stack)
    try:
        got = stack(z, mask)  # gradients on: the original forward, bit for bit
    finally:
        tt.restore(stack)
    assert torch.equal(got, want)


def test_new_checkpoint_is_not_used_stale():
    gen = torch.Generator().manual_seed(6)
    module, other = block(True, 0), block(True, 9)
    pair, mask = pair_of(gen, 1, 50, torch.float32), row_mask(gen, 1, 50, "random")
    tt.accelerate(module)
    with torch.no_grad():
        module(pair, mask)
        module.load_state_dict(other.state_dict())
        got = module(pair, mask)
    check(got, float64_forward(other, pair, mask), mask, True, TOLERANCE["fp32"])


# --- streams, torch.compile, CUDA graphs -----------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_runs_on_torchs_current_stream(dtype):
    """The pair is written on a side stream after a long sleep and read at once on that
    stream: a kernel launched on another stream would read it before it is written."""
    gen = torch.Generator().manual_seed(7)
    module = block(True)
    weights = import_weights(module)
    source, mask = pair_of(gen, 2, 64, dtype), row_mask(gen, 2, 64, "padding")
    tt.triangle_attention(source, mask, weights)  # plans and layouts made first
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pair = torch.zeros_like(source)
        torch.cuda._sleep(200_000_000)
        pair.copy_(source)
        out = tt.triangle_attention(pair, mask, weights)
    side.synchronize()
    check(out, float64_forward(module, source, mask), mask, True, tolerance("fp32", dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_compile_fullgraph(stack, dtype):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(8)
    z, mask = pair_of(gen, 2, 72, dtype), row_mask(gen, 2, 72, "padding")
    precision = "fp32" if dtype == torch.float32 else "bf16"
    tt.accelerate(stack, precision=precision)
    try:
        with torch.no_grad():
            eager = stack(z, mask)
            compiled = torch.compile(stack, fullgraph=True)(z, mask)
    finally:
        tt.restore(stack)
    assert compiled.dtype == dtype
    assert stack_error(compiled, eager, z, mask) <= tolerance(precision, dtype)


def test_cuda_graph_capture_and_replay(stack):
    gen = torch.Generator().manual_seed(9)
    z, mask = pair_of(gen, 2, 64, torch.float32), row_mask(gen, 2, 64, "open")
    tt.accelerate(stack)
    try:
        static_z, static_mask = z.clone(), mask.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad():
            with torch.cuda.stream(side):  # warm-up: plans and layouts made outside capture
                for _ in range(2):
                    stack(static_z, static_mask)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = stack(static_z, static_mask)
            for seed in (10, 11):
                new_z = pair_of(torch.Generator().manual_seed(seed), 2, 64, torch.float32)
                static_z.copy_(new_z)
                graph.replay()
                eager = stack(new_z, static_mask)
                torch.cuda.synchronize()
                assert torch.equal(static_out, eager)
    finally:
        tt.restore(stack)


def test_compile_reduce_overhead_replays(stack):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(12)
    z, mask = pair_of(gen, 1, 48, torch.float32), row_mask(gen, 1, 48, "padding")
    tt.accelerate(stack)
    try:
        compiled = torch.compile(stack, mode="reduce-overhead", fullgraph=True)
        with torch.no_grad():
            eager = stack(z, mask)
            for _ in range(3):  # warm-up, record, replay
                got = compiled(z, mask).clone()
    finally:
        tt.restore(stack)
    assert stack_error(got, eager, z, mask) <= TOLERANCE["fp32"]


def test_capture_without_warm_up_is_a_clear_error():
    gen = torch.Generator().manual_seed(13)
    weights = import_weights(block(True))
    pair, mask = pair_of(gen, 1, 31, torch.float32), row_mask(gen, 1, 31, "padding")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="Run the model once on the same shapes"):
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            tt.triangle_attention(pair, mask, weights)

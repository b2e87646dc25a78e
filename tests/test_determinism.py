"""The same input gives the same bits: on any stream, from any thread, at any address.

A forward's result may depend on (input, weights, precision, options) and nothing else:
not the CuPy stream it runs on, the thread that calls it, the memory pool's history (what
an earlier call left in the scratch it reuses), or where the input and output arrays lie.
Each test computes one reference on the null stream and demands bit-identical outputs
from every other way of calling.

The memory pool is filled with random bits between calls (`_garbage_pool`): a kernel that
read scratch it never wrote would then see different values on each call. Constant
fills (zeros, NaN) are not enough: they can hide such a read behind an order-independent
reduction.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

# (B, N, D, heads): N off every tile (the 128-query tiles of the wgmma path included), on
# both sides of the N where the routes change, with and without the key extent (N >= 512)
CASES = [(1, 200, 128, 4), (2, 130, 64, 4), (1, 600, 128, 4), (1, 97, 128, 4), (2, 61, 32, 2)]
PRECISIONS = ("fp32", "tf32", "bf16")


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


def _garbage_pool(cp, nbytes=256 << 20, seed=0):
    """Fills free blocks of the current stream's pool with random bits (NaN and Inf
    patterns included), then frees them for the next allocations to reuse."""
    blocks = [cp.random.default_rng(seed + k).integers(0, 2 ** 32, nbytes // 4 // 4,
                                                         dtype=cp.uint32)
              for k in range(4)]
    cp.cuda.get_current_stream().synchronize()
    del blocks


def _inputs(rng, B, N, D):
    pair = rng.standard_normal((B, N, N, D), dtype=np.float32)
    mask = (rng.random((B, N, N)) > 0.1).astype(np.float32)
    mask[:, :, -3:] = 0           # padding keys
    mask[0, min(3, N - 1), :] = 0  # a fully-masked query
    return pair, mask


@pytest.fixture(scope="module")
def modules(cp):
    import triattn_cupy as ta

    mods = {}
    for _, _, D, heads in CASES:
        if (D, heads) not in mods:
            mods[D, heads] = ta.TriangleAttention(ta.random_weights(D, heads, seed=D + heads))
    # Call history: every case and precision once, so later calls reuse a busy pool
    rng = np.random.default_rng(1)
    for B, N, D, heads in CASES:
        pair, mask = _inputs(rng, B, N, D)
        for precision in PRECISIONS:
            mods[D, heads](cp.asarray(pair), cp.asarray(mask), precision=precision)
    cp.cuda.Device().synchronize()
    return mods


def _same_bits(actual, expected, what):
    actual = np.asarray(actual)
    assert actual.shape == expected.shape, what
    if not np.array_equal(actual.view(np.uint32), expected.view(np.uint32)):
        differ = actual.view(np.uint32) != expected.view(np.uint32)
        diff = np.abs(actual.astype(np.float64) - expected)
        pytest.fail(f"{what}: {int(differ.sum())} of {differ.size} outputs differ from the "
                    f"null stream's, by up to {np.nanmax(diff):.3g}")


def _same_bits_on_four_threads(cp, call, expected, what):
    """call(t) on four threads released together, each on its own non-blocking stream;
    each result must have `expected`'s bits (`what` names thread t in a failure)."""
    results, errors, start = {}, [], threading.Barrier(4)

    def work(t):
        try:
            with cp.cuda.Stream(non_blocking=True) as stream:
                start.wait()
                out = call(t)
                stream.synchronize()
                results[t] = cp.asnumpy(out)
        except Exception as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for t, out in sorted(results.items()):
        _same_bits(out, expected, what.format(t=t))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_same_bits_on_every_stream_thread_and_address(cp, modules, rng, case, precision):
    B, N, D, heads = case
    module = modules[D, heads]
    pair_host, mask_host = _inputs(rng, B, N, D)
    pair, mask = cp.asarray(pair_host), cp.asarray(mask_host)

    def forward(x=pair, **kw):
        out = module(x, mask, precision=precision, **kw)
        cp.cuda.get_current_stream().synchronize()
        return cp.asnumpy(out)

    _garbage_pool(cp, seed=1)
    expected = forward()
    assert not np.isnan(expected).any(), "NaN in the output (fully_masked='zero')"
    _same_bits(forward(), expected, "a second call on the null stream")

    for label, stream in (("a blocking stream", cp.cuda.Stream()),
                          ("a non-blocking stream", cp.cuda.Stream(non_blocking=True))):
        with stream:
            _garbage_pool(cp, seed=2)
            _same_bits(forward(), expected, label)

    # Inputs and outputs at odd addresses: 4 and 16 bytes past an allocation's start
    for offset in (1, 4):
        buffer = cp.empty(pair.size + offset, cp.float32)
        shifted = buffer[offset:].reshape(pair.shape)
        shifted[...] = pair
        _same_bits(forward(shifted), expected, f"a pair {4 * offset} bytes off alignment")
        out_buffer = cp.full(pair.size + offset, np.nan, cp.float32)
        out = out_buffer[offset:].reshape(pair.shape)
        forward(out=out)
        _same_bits(cp.asnumpy(out), expected, f"out= {4 * offset} bytes off alignment")

    # A fragmented pool: blocks of odd sizes, every other one freed, refilled with garbage
    keep = [cp.empty(int(n), cp.uint8) for n in np.random.default_rng(3).integers(1, 1 << 22, 64)]
    del keep[::2]
    _garbage_pool(cp, nbytes=64 << 20, seed=3)
    _same_bits(forward(), expected, "a fragmented pool")
    del keep

    # Several threads, each on its own stream, calling the one module at once
    def calls(t):
        _garbage_pool(cp, nbytes=32 << 20, seed=10 + t)
        for _ in range(3):
            out = module(pair, mask, precision=precision)
        return out

    _same_bits_on_four_threads(cp, calls, expected, "thread {t} on its own stream")


def test_route_does_not_depend_on_call_order(cp, rng):
    """A fresh module that sees a shape first on another stream gives the same bits."""
    import triattn_cupy as ta

    weights = ta.random_weights(128, 4, seed=5)
    pair, mask = (cp.asarray(a) for a in _inputs(rng, 1, 200, 128))
    first = ta.TriangleAttention(weights)
    with cp.cuda.Stream():
        a = cp.asnumpy(first(pair, mask, precision="bf16"))
    second = ta.TriangleAttention(weights)
    b = cp.asnumpy(second(pair, mask, precision="bf16"))
    _same_bits(a, b.astype(np.float32), "the same shape planned first on another stream")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_first_calls_from_several_threads_at_once(cp, rng, precision):
    """A fresh module's first calls, from four threads on non-blocking streams at once:
    one makes each plan and layout while the others wait, and none reads a layout another
    thread's stream has not finished writing."""
    import triattn_cupy as ta

    weights = ta.random_weights(128, 4, seed=7)
    pair, mask = (cp.asarray(a) for a in _inputs(rng, 1, 200, 128))
    expected = cp.asnumpy(ta.TriangleAttention(weights)(pair, mask, precision=precision))
    module = ta.TriangleAttention(weights)
    _same_bits_on_four_threads(cp, lambda t: module(pair, mask, precision=precision),
                               expected, "thread {t}'s first call")

"""Kernel arguments that need no GPU to check: the parameter blocks the launches pass to
cuLaunchKernel (triattn_cupy/gpu/launch.py), the projection weights' chunk layout."""
import numpy as np
import pytest

from triattn_cupy import gpu

pytest.importorskip("cupy")


def test_arguments_sit_in_8_byte_slots_in_their_own_width():
    """cuLaunchKernel reads each parameter's size from its slot's address: little-endian
    values at the start of 8-byte slots, the rest zero."""
    args = gpu.launch.KernelArgs((gpu.launch.I32(-3), gpu.launch.I64(-(1 << 40)), gpu.launch.F32(1e-5),
                               gpu.launch.Ptr(0xDEAD0000BEEF), None), ((4, "pair"),))
    slots = args.values({"pair": 0x7F0012345600})
    assert slots.dtype == np.uint64 and len(slots) == 5
    raw = slots.view(np.uint8).reshape(5, 8)
    assert raw[0, :4].view(np.int32)[0] == -3 and not raw[0, 4:].any()
    assert raw[1].view(np.int64)[0] == -(1 << 40)
    assert raw[2, :4].view(np.float32)[0] == np.float32(1e-5) and not raw[2, 4:].any()
    assert slots[3] == 0xDEAD0000BEEF and slots[4] == 0x7F0012345600


def test_parameter_array_points_at_each_slot_of_the_threads_block():
    import ctypes

    args = gpu.launch.KernelArgs((None, gpu.launch.I32(7), None), ((0, "qkvg"), (2, "out")))
    params = args.fill({"qkvg": 1 << 33, "out": 5 << 20})
    addresses = np.ctypeslib.as_array((ctypes.c_uint64 * 3).from_address(params))
    values = [ctypes.c_uint64.from_address(int(a)).value for a in addresses]
    assert values == [1 << 33, 7, 5 << 20]
    assert args.fill({"qkvg": 1, "out": 2}) == params  # the same block, refilled
    assert [ctypes.c_uint64.from_address(int(a)).value for a in addresses] == [1, 7, 2]


def test_each_thread_fills_its_own_parameter_block():
    """Two threads launching the same plan must not pass each other's pointers."""
    import threading

    args = gpu.launch.KernelArgs((None,), ((0, "pair"),))
    mine = args.fill({"pair": 1})
    theirs = {}
    thread = threading.Thread(target=lambda: theirs.update(p=args.fill({"pair": 2})))
    thread.start()
    thread.join()
    assert theirs["p"] != mine
    assert args.values({"pair": 1})[0] == 1


def test_arguments_left_to_the_call_must_be_its_slots():
    with pytest.raises(ValueError, match="pointer slots"):
        gpu.launch.KernelArgs((None, gpu.launch.I32(1)), ((1, "pair"),))
    with pytest.raises(TypeError, match="argument 0"):
        gpu.launch.KernelArgs((np.ones(2),), ())


def test_programmatic_launch_structures_have_the_drivers_layout():
    """CUlaunchAttribute is 72 bytes (id, padding, a 64-byte union) and CUlaunchConfig 56
    on 64-bit hosts (cuda.h); the attribute is PROGRAMMATIC_STREAM_SERIALIZATION (6) = 1."""
    import ctypes

    from triattn_cupy.gpu import dependent_launch as dl

    assert ctypes.sizeof(dl._LaunchAttribute) == 72 and ctypes.sizeof(dl._LaunchConfig) == 56
    assert dl._LaunchConfig.stream.offset == 32 and dl._LaunchConfig.attrs.offset == 40
    attribute = dl.programmatic_attribute()
    assert attribute.id == 6 and bytes(attribute)[8:12] == (1).to_bytes(4, "little")
    assert not any(bytes(attribute)[12:])
    assert not dl.supported(80) and not dl.supported(86)  # (before 9.0: never asked)
    assert not dl.chosen(90, dl.MAX_ROWS + 1) and not dl.chosen(80, 1)


def test_dependent_launches_are_per_thread_and_nest():
    import threading

    from triattn_cupy.gpu import dependent_launch as dl

    assert not dl.active()
    seen = {}
    with dl.launches_as_dependents():
        assert dl.active()
        thread = threading.Thread(target=lambda: seen.update(other=dl.active()))
        thread.start()
        thread.join()
        with dl.launches_as_dependents(False):
            assert not dl.active()
        assert dl.active()
    assert not dl.active() and seen == {"other": False}


def test_only_dependent_launches_go_out_programmatically(monkeypatch):
    """Inside launches_as_dependents() a Launch marked dependent goes through
    cuLaunchKernelEx with its grid, block, shared memory, stream and parameters; an
    unmarked one, and every one outside, through cuLaunchKernel."""
    import types

    from triattn_cupy.gpu import dependent_launch as dl

    calls = []
    monkeypatch.setattr(gpu.launch, "_api", (
        lambda *a: calls.append(("plain",) + a[:8]), lambda: types.SimpleNamespace(ptr=77)))
    monkeypatch.setattr(dl, "launch", lambda *a: calls.append(("dependent",) + a[:5]))

    def made(dependent):
        launch = object.__new__(gpu.launch.Launch)
        launch.function, launch.grid, launch.block, launch.smem = 1234, 9, 256, 4096
        launch.args = gpu.launch.KernelArgs((None,), ((0, "qkvg"),))
        launch.dependent = dependent
        return launch

    attention, project = made(True), made(False)
    attention({"qkvg": 1}), project({"qkvg": 1})
    with dl.launches_as_dependents():
        attention({"qkvg": 1}), project({"qkvg": 1})
    kinds = [call[0] for call in calls]
    assert kinds == ["plain", "plain", "dependent", "plain"]
    assert calls[2][1:5] == (1234, 9, 256, 4096) and calls[2][5] == 77


@pytest.mark.parametrize("no,d", [(512, 128), (4, 4), (130, 20), (3072, 768)])
def test_weight_chunks_are_the_rings_chunks_in_order(no, d):
    """project_mma.cu reads chunk (pass p, k-chunk c) of W as the contiguous block at
    (p * chunks + c) * BN * BK, [BN rows][BK columns], zero past NO and D."""
    from triattn_cupy import gpu

    bn, bk = gpu.tiles.PROJECT_MMA_CHUNK
    w = np.random.default_rng(0).standard_normal((no, d)).astype(np.float32)
    flat = gpu.device_weights.weight_chunks(w).reshape(-1)
    chunks = -(-d // bk)
    for p in range(-(-no // bn)):
        for c in range(chunks):
            got = flat[(p * chunks + c) * bn * bk:][:bn * bk].reshape(bn, bk)
            want = np.zeros((bn, bk), np.float32)
            part = w[p * bn:(p + 1) * bn, c * bk:(c + 1) * bk]
            want[:part.shape[0], :part.shape[1]] = part
            assert np.array_equal(got, want), (p, c)


@pytest.mark.parametrize("no,d", [(512, 128), (130, 32), (3072, 768)])
def test_f16_hi_chunks_are_the_one_product_rings_chunks(no, d):
    """project_mma.cu F16_TERMS 1 reads chunk (pass p, k-chunk c) as the contiguous 8 KiB at
    (p * D / 32 + c) * 8192 bytes, row n = fp16(W[p BN + n, 32 c : 32 c + 32]), zero past
    NO."""
    from triattn_cupy import gpu

    bn, bk = gpu.tiles.PROJECT_MMA_HI_CHUNK
    assert bk == 32 and bn * bk * 2 == 8192  # the ring's 8 KiB stages
    w = np.random.default_rng(0).standard_normal((no, d)).astype(np.float32) * 300
    got = gpu.device_weights.f16_hi_chunks(w)
    assert got.dtype == np.float32 and got.flags.c_contiguous
    flat = got.reshape(-1).view(np.float16)
    chunks = d // bk
    for p in range(-(-no // bn)):
        for c in range(chunks):
            chunk = flat[(p * chunks + c) * bn * bk:][:bn * bk].reshape(bn, bk)
            want = np.zeros((bn, bk), np.float16)
            part = w[p * bn:(p + 1) * bn, c * bk:(c + 1) * bk].astype(np.float16)
            want[:part.shape[0]] = part
            assert np.array_equal(chunk, want), (p, c)


def test_f16_hi_chunks_need_d_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        gpu.device_weights.f16_hi_chunks(np.ones((128, 48), np.float32))


def _w_piece(r, c):  # project_mma.cu w_piece
    return r * 64 + (((c ^ (r >> 1)) & 3) << 4)


def _ldsm_x4(smem, addresses):
    """ldmatrix.x4 of 16-bit values: lanes 8 i to 8 i + 7 give the row addresses of matrix i;
    lane T gets, from each matrix, row T / 4, values 2 (T % 4) and 2 (T % 4) + 1.
    Returns [32 lanes][4 matrices][2] float64."""
    out = np.empty((32, 4, 2))
    for i in range(4):
        for lane in range(32):
            at = addresses[8 * i + lane // 4] + 4 * (lane % 4)
            out[lane, i] = smem[at:at + 4].view(np.float16)
    return out


def _mma_m16n8k16(c, a, b):
    """c [16, 8] += A B from the fragments of mma.m16n8k16 (a [32][4][2], b [32][2][2])."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for e in range(2):
            A[g, 2 * t + e], A[g + 8, 2 * t + e] = a[lane, 0, e], a[lane, 1, e]
            A[g, 2 * t + 8 + e], A[g + 8, 2 * t + 8 + e] = a[lane, 2, e], a[lane, 3, e]
            B[2 * t + e, g], B[2 * t + 8 + e, g] = b[lane, 0, e], b[lane, 1, e]
    c += A @ B


@pytest.mark.parametrize("d", [32, 96])
def test_one_product_loop_reads_matching_k_of_the_row_tile_and_the_ring(d):
    """An emulation of project_mma.cu's F16_TERMS 1 product loop for one pass of a 64-row
    block (ring.issue's copy into the swizzled stage, multiply_chunk's ldmatrix addresses,
    the m16n8k16 fragments): ring chunk kc's bytes 0-31 / 32-63 per row meet the hi halves
    of the row tile's 16-column chunks 2 kc / 2 kc + 1, so the result is hi(A) hi(W)^T.
    The row tile's lo halves hold NaN: read anywhere, they would show."""
    bm, bn, bk, astr = 64, 128, 16, d + 4
    rng = np.random.default_rng(4)
    a = rng.standard_normal((bm, d)).astype(np.float16)
    w = rng.standard_normal((bn, d)).astype(np.float32)
    # As: [BM][astr] words, each 16-column chunk as 16 fp16 hi then 16 lo (NaN here)
    tile = np.full((bm, astr * 2), np.nan, np.float16)
    for c0 in range(0, d, bk):
        tile[:, 2 * c0:2 * c0 + bk] = a[:, c0:c0 + bk]
    tile_bytes = tile.reshape(-1).view(np.uint8)
    chunks = gpu.device_weights.f16_hi_chunks(w).reshape(-1).view(np.uint8).reshape(-1, bn * 64)
    assert len(chunks) == d // 32
    got = np.zeros((bm, bn))
    for kc, chunk in enumerate(chunks):
        stage = np.zeros(bn * 64, np.uint8)
        for idx in range(bn * 4):  # WeightRing.issue: 16-byte piece idx to row idx / 4
            at = _w_piece(idx // 4, idx % 4)
            stage[at:at + 16] = chunk[16 * idx:16 * idx + 16]
        for warp in range(8):
            row0, col0 = (warp // 4) * (bm // 2), (warp % 4) * 32
            lanes = np.arange(32)
            a_lane = 4 * ((row0 + (lanes & 15)) * astr + 4 * (lanes >> 4)) + 4 * kc * 2 * bk
            w_lane = _w_piece(col0 + (lanes & 7) + 8 * (lanes >> 4), (lanes >> 3) & 1)
            for s in range(2):
                b = [_ldsm_x4(stage, (w_lane + jp * 16 * 64) ^ (32 * s)) for jp in range(2)]
                frags = [b[0][:, 0:2], b[0][:, 2:4], b[1][:, 0:2], b[1][:, 2:4]]
                for i in range(bm // 32):
                    af = _ldsm_x4(tile_bytes, a_lane + 4 * (i * 16 * astr + s * bk))
                    for j in range(4):
                        _mma_m16n8k16(got[row0 + 16 * i:][:16, col0 + 8 * j:][:, :8], af, frags[j])
    want = a.astype(np.float64) @ w.astype(np.float16).astype(np.float64).T
    assert np.allclose(got, want, rtol=1e-12, atol=1e-9)

def _worst_case_rows(w, gamma, rng):
    """LayerNorm-normalised rows n (|n|_2 = sqrt(D); the mean need not be 0 for the bound)
    reaching each column's bound, n = +-sqrt(D) u with u the unit vector along gamma * W[c]
    (zero where that is zero), and 256 random rows."""
    import math

    D = w.shape[1]
    u = w * gamma
    norms = np.linalg.norm(u, axis=1, keepdims=True)
    u = np.divide(u, norms, out=np.zeros_like(u), where=norms > 0)
    return np.concatenate([math.sqrt(D) * u, -math.sqrt(D) * u, rng.standard_normal((256, D))])


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e4])
@pytest.mark.parametrize("D,h", [(128, 4), (64, 2), (96, 3)])
def test_f16x3_scales_keep_q_k_v_inside_fp16(D, h, magnitude):
    """The fp32 mode's fp16 split: powers of two that put every value of q (with its
    log2(e)/sqrt(d)), k and v at or below F16X3_TOP, for any input; with LayerNorm rows
    chosen to reach each column's bound (n parallel to gamma * W[c]) and random rows, and
    the largest values not far below the top (no needless loss to fp16's subnormals)."""
    import math

    import triattn_cupy as ta

    base = ta.random_weights(D, h, seed=5)
    params = {k: (v * np.float32(magnitude) if k.split(".")[0] in ("query", "key", "value")
                  else v) for k, v in base.params.items()}
    weights = ta.Weights(D, h, base.layer_norm_eps, params)
    scales = gpu.scales.f16x3_scales(weights)
    gamma, beta = params["layer_norm.weight"].astype(np.float64), params["layer_norm.bias"]
    rng = np.random.default_rng(1)
    for (name, factor), s in zip((("query", gpu.scales.LOG2E / math.sqrt(D // h)), ("key", 1.0),
                                  ("value", 1.0)), scales):
        assert s == 2.0 ** round(math.log2(s))
        w, b = params[f"{name}.weight"].astype(np.float64), params[f"{name}.bias"]
        n = _worst_case_rows(w, gamma, rng)
        values = ((n * gamma + beta) @ w.T + b) * factor * s
        top = np.abs(values).max()
        assert top <= gpu.scales.F16X3_TOP
        assert top > gpu.scales.F16X3_TOP / 4  # the worst case reaches within a factor 2 of the scale step


def test_f16x3_scales_of_zero_weights_are_one():
    import triattn_cupy as ta

    base = ta.random_weights(32, 2, seed=5)
    params = {k: np.zeros_like(v) if k.split(".")[0] in ("query", "key", "value") else v
              for k, v in base.params.items()}
    assert gpu.scales.f16x3_scales(ta.Weights(32, 2, base.layer_norm_eps, params)) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("qk,bias", [(1.0, 1.0), (1e-4, 1.0), (1e3, 1.0), (1.0, 1e4), (1.0, 0.0)])
def test_f16_biased_scales_keep_the_scaled_bias_inside_fp16(qk, bias):
    """The tf32 mode's one fp16 product (F16X1) accumulates S onto the pair bias stored
    times s_b = s_q s_k: every bias value (worst-case LayerNorm rows) times s_b stays at or
    below F16X3_TOP; s_q, s_k never exceed f16x3's (q and k stay inside fp16) and come down
    only as far as the bias needs (within a factor 4 of the top)."""
    import triattn_cupy as ta

    D, h = 128, 4
    base = ta.random_weights(D, h, seed=6)
    params = {k: (v * np.float32(qk) if k.split(".")[0] in ("query", "key") else
                  v * np.float32(bias) if k.startswith("bias_proj") else v)
              for k, v in base.params.items()}
    weights = ta.Weights(D, h, base.layer_norm_eps, params)
    qkv = gpu.scales.f16x3_scales(weights)
    s_q, s_k, s_v, s_b = gpu.scales.f16_biased_scales(weights, qkv)
    assert s_b == s_q * s_k and s_v == qkv[2]
    assert s_q <= qkv[0] and s_k <= qkv[1] and s_q / s_k in (qkv[0] / qkv[1], 2 * qkv[0] / qkv[1])
    gamma, beta = params["layer_norm.weight"].astype(np.float64), params["layer_norm.bias"]
    wb = params["bias_proj.weight"].astype(np.float64)
    n = _worst_case_rows(wb, gamma, np.random.default_rng(3))
    top = np.abs((n * gamma + beta) @ wb.T).max() * gpu.scales.LOG2E * s_b
    assert top <= gpu.scales.F16X3_TOP
    if s_b < qkv[0] * qkv[1]:  # brought down for the bias: no further than needed
        assert top > gpu.scales.F16X3_TOP / 4


def test_f16_split_chunks_hold_each_row_as_fp16_hi_then_lo():
    """project_mma.cu F16_TERMS reads each 16-value chunk row as 16 fp16 hi then 16 lo:
    hi + lo within ~2^-22 of the value (relative to the chunk's largest), same bytes."""
    chunks = np.random.default_rng(2).standard_normal((2, 3, 128, 16)).astype(np.float32) * 300
    split = gpu.device_weights.f16_split_chunks(chunks)
    assert split.shape == chunks.shape and split.dtype == np.float32
    halves = split.view(np.uint16).reshape(2, 3, 128, 32)
    hi = halves[..., :16].view(np.float16).astype(np.float64)
    lo = halves[..., 16:].view(np.float16).astype(np.float64)
    assert np.array_equal(hi, chunks.astype(np.float16).astype(np.float64))
    assert np.abs(hi + lo - chunks).max() <= 2.0 ** -21 * np.abs(chunks).max()


@pytest.mark.parametrize("scaled", [True, False], ids=["f16x3_tiles", "unscaled"])
@pytest.mark.parametrize("magnitude", [1e-5, 1.0, 3e3])
def test_f16_projection_scales_bound_layernorm_outputs_and_weights(magnitude, scaled):
    """a_scale keeps every LayerNorm output (|n|_2 <= sqrt(D) per row) and w_scale every
    scaled weight at or below F16X3_TOP, each within a factor 2 of it: with q, k, v
    scaled into fp16 for the f16x3 attention (tiles_f16_hilo) or stored unscaled (rows_fp32:
    DeviceWeights.f16_scales(None), qkv_scales (1, 1, 1, 1))."""
    import math

    import triattn_cupy as ta

    D, h = 64, 2
    base = ta.random_weights(D, h, seed=8)
    params = {k: (v * np.float32(magnitude) if k.startswith("layer_norm") else v)
              for k, v in base.params.items()}
    weights = ta.Weights(D, h, base.layer_norm_eps, params)
    qkv = gpu.scales.f16x3_scales(weights) if scaled else (1.0, 1.0, 1.0)
    scales = gpu.scales.f16_projection_scales(weights, (*qkv, 1.0))
    a_scale, w_scale = scales.a, scales.w
    gamma, beta = params["layer_norm.weight"], params["layer_norm.bias"]
    top = (math.sqrt(D) * np.abs(gamma) + np.abs(beta)).max() * a_scale
    assert gpu.scales.F16X3_TOP / 2 < top <= gpu.scales.F16X3_TOP
    rows = np.concatenate([params[f"{n}.weight"] * s for n, s in
                           zip(("query", "key", "value", "gate"), (*qkv, 1.0))])
    w_top = max(np.abs(rows).max(), np.abs(params["bias_proj.weight"]).max()) * w_scale
    assert gpu.scales.F16X3_TOP / 2 < w_top <= gpu.scales.F16X3_TOP
    out_w_top = np.abs(params["out_proj.weight"]).max() * scales.out_w
    assert gpu.scales.F16X3_TOP / 2 < out_w_top <= gpu.scales.F16X3_TOP
    # (g * o: scaled per block by the out projection itself, load_gated_tile_f16)


@pytest.mark.parametrize("qk,bias", [(1.0, 1.0), (1e-4, 1.0), (30.0, 1.0), (1.0, 1e2), (1.0, 0.0)])
def test_f16s_scales_keep_s_inside_fp16(qk, bias):
    """The bf16 mode's f16s option accumulates S = bias c + q_s . k_s in fp16 (c = s_q s_k):
    for rows reaching each projection's bound and random rows, every |bias c| + |q_s . k_s|
    (per head, every query-key pair of the rows) stays at or below S16_TOP, and so does every
    partial sum of the dot product; c is a power of two in [1, S16_MAX_C], s_v f16x3's, and
    q and k scaled stay inside fp16 (at most 2^9)."""
    import math

    import triattn_cupy as ta

    D, h = 128, 4
    d = D // h
    base = ta.random_weights(D, h, seed=8)
    params = {k: (v * np.float32(qk) if k.split(".")[0] in ("query", "key") else
                  v * np.float32(bias) if k.startswith("bias_proj") else v)
              for k, v in base.params.items()}
    weights = ta.Weights(D, h, base.layer_norm_eps, params)
    scales = gpu.scales.f16s_scales(weights, 2.0 ** 11)
    assert scales is not None
    s_q, s_k, s_v, c = scales
    assert c == s_q * s_k and s_v == 2.0 ** 11 and 1 <= c <= gpu.scales.S16_MAX_C
    assert all(s == 2.0 ** round(math.log2(s)) for s in scales)
    gamma, beta = params["layer_norm.weight"].astype(np.float64), params["layer_norm.bias"]
    rng = np.random.default_rng(4)

    def project(name, factor, rows):
        w, b = params[f"{name}.weight"].astype(np.float64), params.get(f"{name}.bias", 0.0)
        return ((rows * gamma + beta) @ w.T + b) * factor

    for head in range(h):
        cols = slice(head * d, (head + 1) * d)
        rows = {name: _worst_case_rows(params[f"{name}.weight"].astype(np.float64)[cols],
                                       gamma, rng) for name in ("query", "key")}
        q = project("query", gpu.scales.LOG2E / math.sqrt(d), rows["query"])[:, cols] * s_q
        k = project("key", 1.0, rows["key"])[:, cols] * s_k
        assert np.abs(q).max() <= 2 ** 9 and np.abs(k).max() <= 2 ** 9
        partial = np.abs(np.cumsum(q[:, None, :] * k[None, :, :], axis=-1)).max()
        wb = params["bias_proj.weight"].astype(np.float64)
        b_top = np.abs(project("bias_proj", gpu.scales.LOG2E, _worst_case_rows(wb, gamma, rng))).max()
        assert partial + b_top * c <= gpu.scales.S16_TOP


def test_f16s_scales_refuse_scores_past_fp16():
    """Scores that could pass 2^15 in log2 units (q and k weights x 1e3: ~1e6) leave c
    below 1: no f16s scales (the Plan then takes the bf16 variant)."""
    import triattn_cupy as ta

    base = ta.random_weights(64, 2, seed=3)
    params = {k: (v * np.float32(1e3) if k.split(".")[0] in ("query", "key") else v)
              for k, v in base.params.items()}
    assert gpu.scales.f16s_scales(ta.Weights(64, 2, base.layer_norm_eps, params), 1.0) is None


def test_default_routes_by_gpu_and_size():
    """The one route function (routes.choose_route): the route each GPU and size takes."""
    from triattn_cupy import gpu

    choose = gpu.routes.choose_route
    assert choose("bf16", 32, 128, 1024, 75).name == "ffma"
    assert choose("fp32", 16, 64, 1024, 80).name == "mma_f16x3"
    assert choose("fp32", 96, 192, 100, 80).name == "mma_f16x3_ffma"
    assert choose("tf32", 32, 128, 1024, 80, smem_limit=163 * 1024).name == "mma_tf32"
    assert choose("tf32", 128, 256, 100, 90).name == "mma_tf32_ffma"
    assert choose("bf16", 32, 128, 128, 90).name == "mma_bf16"
    assert choose("fp32", 32, 128, 129, 90).name == "wgmma_f16x3_persistent"
    assert choose("fp32", 32, 64, 129, 90).name == "wgmma_f16x3"
    assert choose("tf32", 32, 128, 1024, 90).name == "wgmma_f16_persistent"
    slots_from, f16s_from = gpu.routes.F16S_SLOTS_FROM_N, gpu.routes.F16S_FROM_N
    assert choose("bf16", 32, 128, slots_from - 1, 90).name == "wgmma_bf16_persistent"
    assert choose("bf16", 32, 128, slots_from, 90).name == "wgmma_f16s_slots"
    # (unaligned rows: no slot rows; the persistent out projection, project_mma's LayerNorm)
    unaligned = choose("bf16", 32, 128, slots_from, 90, rows_aligned=False)
    assert (unaligned.name, unaligned.project, unaligned.out_project) == (
        "wgmma_bf16_persistent", "mma", "persistent")
    assert choose("bf16", 32, 128, f16s_from, 90, rows_aligned=False).name == "wgmma_f16s_persistent"
    assert choose("bf16", 32, 64, f16s_from - 1, 90).name == "wgmma_bf16"
    assert choose("bf16", 32, 64, f16s_from, 90).name == "wgmma_f16s"
    assert choose("bf16", 32, 64, f16s_from, 90, f16s_scales=False).name == "wgmma_bf16"
    route = choose("bf16", 32, 128, 4096, 90, masked=True)
    assert route.key_extent and route.layout == gpu.layouts.TILES_F16_SLOTS
    assert route.scales == "f16s" and route.products == "f16"
    assert not choose("bf16", 32, 128, gpu.routes.KEY_EXTENT_MIN_N - 1, 90, masked=True).key_extent


def test_forced_routes_and_their_errors():
    from triattn_cupy import gpu

    choose = gpu.routes.choose_route
    for name in gpu.routes.ROUTES:  # every route forceable on an H200 where its shape allows
        parts = gpu.routes.route_parts(name)
        d, D = (32, 128) if parts["project"] == "persistent" or "wgmma" in parts["attention"] else (16, 64)
        route = choose(parts["precisions"][0], d, D, 300, 90, force=name)
        assert route.name == name and route.attention == parts["attention"]
    a100 = choose("tf32", 32, 128, 1024, 90, force="mma_tf32@sm_80")
    assert a100.tile_table == "sm_80" and a100.name == "mma_tf32@sm_80"
    assert (a100.attention_launch(32, 1024)
            == gpu.kernel_configs.attention_mma_launch(32, "tf32", n=1024, compute_capability=80))
    with pytest.raises(ValueError, match="route must be"):
        choose("fp32", 32, 128, 300, 90, force="nope")
    with pytest.raises(ValueError, match="serves precision"):
        choose("fp32", 32, 128, 300, 90, force="mma_tf32")
    with pytest.raises(ValueError, match="compute capability 9.0"):
        choose("tf32", 32, 128, 300, 80, force="wgmma_f16")
    with pytest.raises(ValueError, match="head dims"):
        choose("tf32", 24, 96, 300, 90, force="wgmma_f16")
    with pytest.raises(ValueError, match="pair_dim 128"):
        choose("tf32", 32, 64, 300, 90, force="wgmma_f16_persistent")
    with pytest.raises(ValueError, match="fp16's range"):
        choose("bf16", 32, 128, 300, 90, force="wgmma_f16s", f16s_scales=False)
    with pytest.raises(ValueError, match="8.0 or newer"):
        choose("tf32", 16, 64, 300, 75, force="mma_tf32")


def test_the_f16s_launch_reads_tiles_f16_with_its_own_scales():
    from triattn_cupy import gpu

    launch = gpu.routes.attention_kernel(32, "bf16", 90, 1024)
    assert launch.name == "attention_wgmma_f16s"
    assert launch.layout == gpu.layouts.TILES_F16_SLOTS
    assert ("S16", 1) in launch.config.defines and ("F16X1", 1) in launch.config.defines
    assert gpu.routes.attention_kernel(32, "bf16", 90, 128).name == "attention_mma_bf16"
    assert gpu.routes.attention_kernel(32, "tf32", 90, 1024).name == "attention_wgmma_f16"
    f16 = gpu.kernel_configs.attention_wgmma_launch(32, variant="f16")
    assert gpu.kernel_configs.attention_wgmma_launch(32, variant="f16s").smem == f16.smem
    assert gpu.routes.choose_route("tf32", 32, 64, 1024, 90).scales == "f16_biased"


def test_the_library_reads_no_environment_variable():
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "triattn_cupy" / "gpu"
    for path in root.glob("*.py"):
        text = path.read_text()
        assert "os.environ" not in text or path.name == "compile.py", path  # (CuPy's cache dir)


def test_layouts_emit_their_features():
    from triattn_cupy import gpu

    L = gpu.layouts
    assert L.ROWS_FP32.defines() == ()
    assert dict(L.TILES_F16_HILO.defines()) == {"KV_TILED": 1, "F16_QKV": 1, "HI_LO": 1,
                                                "BIAS_F16": 1}
    assert {layout.name for layout in L.LAYOUTS} == {
        "rows_fp32", "rows_tf32", "rows_bf16", "tiles_bf16", "tiles_f16_hilo", "tiles_f16",
        "tiles_f16_slots"}
    for layout in L.LAYOUTS:
        assert layout.tiled == ("KV_TILED" in dict(layout.defines()))
        assert layout.slot_rows == ("SLOT_ROWS" in dict(layout.defines()))
        assert bool(layout.o16) == ("O16" in dict(layout.defines())) or layout is L.TILES_F16_SLOTS


def test_signature_binds_by_name():
    sig = gpu.launch.Signature("ptr x", "i32 n", "f32 scale")
    args, slots = sig.bind(x=gpu.launch.Call("pair"), n=3, scale=0.5)
    assert args[0] is None and int(args[1]) == 3 and float(args[2]) == 0.5
    assert slots == ((0, "pair"),)
    with pytest.raises(TypeError, match="missing"):
        sig.bind(x=gpu.launch.Call("pair"), n=3)
    with pytest.raises(TypeError, match="scale is f32: a call supplies pointers and integers"):
        sig.bind(x=0, n=3, scale=gpu.launch.Call("scale"))
    # an integer each call supplies (row blocks' row_begin, M): a slot of its own
    args, slots = sig.bind(x=gpu.launch.Call("pair"), n=gpu.launch.Call("n"), scale=0.5)
    assert args[:2] == (None, None) and slots == ((0, "pair"), (1, "n"))
    values = gpu.launch.KernelArgs(args, slots).values({"pair": 1 << 40, "n": 7})
    assert values[1] == 7 and values[0] == 1 << 40

"""Every kernel configuration compiles with NVRTC for sm_80 and sm_90 without a GPU, and
ptxas reports no register spills beyond the known, bounded ones (_allowed_spill_bytes).
Runs in CI (the cuda13-slim extra brings NVRTC and the CUDA headers)."""
from __future__ import annotations

import itertools

import pytest

from triattn_cupy import gpu
from helpers import compile_ptx_or_fail

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                            reason="CuPy's NVRTC bindings are needed to compile kernels")


def _nvrtc_usable():
    try:
        nvrtc.getVersion()
        return True
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _nvrtc_usable(),
                                reason="NVRTC library not found (pip install 'cupy-cuda13x[ctk]')")


def _allowed_spill_bytes(config, arch) -> int:
    """The spills ptxas reports, each bounded so that a new or larger one fails:
    - the split projections (fp16 hi + lo: F16_TERMS 3) at 128 registers, up to 72 bytes
      (the 128-row out projection, launched only at small sizes (out_project_rows),
      spills 4);
    - 32 bytes in the 3xTF32 attention (the f16x3 attention's accuracy oracle) at head dim
      24 on sm_90, whose 2-blocks-per-SM shape measured 25% faster than the spill-free
      ones; 8 bytes in its row-masked form (ROW_MASK) at head dim 64, 16 in row blocks
      (ROW_BLOCK) besides;
    - 8 bytes in the wgmma f16x3 attention with both ROW_MASK and ROW_BLOCK (row blocks of
      a row-masked fp32 forward on sm_90; its 2 blocks per SM kept).
    Every other kernel: none."""
    defines = dict(config.defines)
    if defines.get("ROW_BLOCK") and defines.get("ROW_MASK"):
        if (config.filename == "attention_mma.cu" and defines["PREC"] == gpu.kernel_configs.PREC_TF32X3
                and defines["HEAD_DIM"] == 64):
            return 16  # the oracle's row-masked form (no GPU takes it)
        if config.filename == "attention_wgmma.cu" and defines.get("F16X3"):
            return 8
    if (config.filename == "attention_mma.cu" and defines["PREC"] == gpu.kernel_configs.PREC_TF32X3
            and defines["HEAD_DIM"] == 24 and defines["MIN_BLOCKS"] == 2 and arch == "sm_90"):
        return 32  # chosen by measurement over the spill-free shapes (tiles.py)
    if config.filename == "project_mma.cu" and defines.get("SPLIT"):
        return 72
    if (config.filename == "attention_mma.cu" and defines["PREC"] == gpu.kernel_configs.PREC_TF32X3
            and defines.get("ROW_MASK") and defines["HEAD_DIM"] == 64):
        return 8  # the oracle's row-masked form at 255 registers (no GPU takes it)
    return 0


def _compile_within_spill_allowance(config, arch) -> dict:
    """The ptxas report of `config` compiled for `arch`, checked: no serialized wgmma
    (ptxas C7513: it cannot keep their register operands safe while they run, as a
    pipelined register-A loop did, at no error; C7519: a wgmma under a branch, as
    project_wgmma.cu's pair bias in one warpgroup only) and no spills beyond the
    configuration's allowance."""
    log = gpu.compile.compile_offline(config.filename, config.defines, config.arch or arch)
    report = gpu.compile.ptxas_report(log)
    assert report, f"no ptxas report in:\n{log}"
    assert "C7513" not in log and "C7519" not in log, log
    allowed = _allowed_spill_bytes(config, arch)
    for entry, usage in report.items():
        assert usage["spill_stores"] <= allowed and usage["spill_loads"] <= allowed, (entry, usage)
        assert usage["stack"] <= allowed, (entry, usage)
    return report


def each_config(configs_of):
    """Parametrize over (config, arch): `configs_of(arch)` for each architecture checked,
    named by file and defines."""
    return pytest.mark.parametrize(
        "config,arch", [(c, a) for a in gpu.gpus.CHECK_ARCHS for c in configs_of(a)],
        ids=lambda x: x if isinstance(x, str) else
        x.filename + ":" + ",".join(f"{k}={v}" for k, v in x.defines))


# Each architecture's own configurations (the tile table may pick per architecture).
@each_config(gpu.kernel_catalog.all_configs)
def test_compiles_without_spills(config, arch):
    _compile_within_spill_allowance(config, arch)


# The ending node's out projections (OUT_TRANSPOSED: rows to the caller's layout), one
# configuration per kernel file: the feature is the same store in each.
@each_config(gpu.kernel_catalog.transposed_out_configs)
def test_transposed_output_compiles_without_spills(config, arch):
    report = _compile_within_spill_allowance(config, arch)
    assert any(entry.startswith("gated_out_project") for entry in report), report


# The row mask layout's attention (ROW_MASK: key bits per row) and its packing kernel: each
# variant's smallest and largest head dim (kernel_catalog.row_masked_configs).
@each_config(gpu.kernel_catalog.row_masked_configs)
def test_row_mask_compiles_without_spills(config, arch):
    _compile_within_spill_allowance(config, arch)


# The pair read and the output written in 16 bits (PAIR_DTYPE float16, bfloat16): each
# route's projection kernels in their smallest configuration, per 16-bit type, half of
# them with OUT_TRANSPOSED (kernel_catalog.pair_dtype_configs).
@each_config(gpu.kernel_catalog.pair_dtype_configs)
def test_16_bit_pair_compiles_without_spills(config, arch):
    report = _compile_within_spill_allowance(config, arch)
    assert any(entry.startswith("ln_qkvg_project") for entry in report), report
    assert any(entry.startswith("gated_out_project") for entry in report), report


def test_16_bit_pair_configs_cover_every_route_and_both_types():
    """Every route's projection kernels (the default D = 128 ones) are among the 16-bit
    configurations of its architecture, in float16 and bfloat16, and float32 emits no
    define: its configurations, and so its machine code, are the ones without the
    feature."""
    from triattn_cupy.gpu import kernel_catalog, routes

    for arch, cc in (("sm_80", 80), ("sm_90", 90)):
        compiled = {(c.filename, tuple(d for d in c.defines if d[0] != "OUT_TRANSPOSED"))
                    for c in kernel_catalog.pair_dtype_configs(arch)}
        taken = set()
        for name, precision in itertools.product(routes.ROUTES, gpu.checks.PRECISIONS):
            try:
                route = routes.choose_route(precision, 32, 128, 384, cc, force=name)
            except ValueError:
                continue
            taken.add(name)
            for dtype in ("float16", "bfloat16"):
                configs = [gpu.kernel_configs.persistent_project_config(route.layout, dtype)
                           if engine == "persistent" else
                           gpu.kernel_configs.project_config(gpu.tiles.out_project_rows(), engine, 128,
                                                 route.layout, route.products, dtype)
                           for engine in (route.project, route.out_project)]
                for c in configs:
                    assert (c.filename, c.defines) in compiled, (name, dtype, c)
        assert len(taken) >= (15 if cc == 90 else 5), taken
    config = gpu.kernel_configs.project_config(64, "mma", 128, gpu.layouts.ROWS_TF32, "tf32")
    assert gpu.kernel_configs.project_config(64, "mma", 128, gpu.layouts.ROWS_TF32, "tf32",
                                 "float32") == config
    assert "PAIR_DTYPE" not in dict(config.defines)
    assert dict(gpu.kernel_configs.with_pair_dtype(config, "bfloat16").defines)["PAIR_DTYPE"] == 2
    with pytest.raises(ValueError, match="pair_dtype must be one of"):
        gpu.kernel_configs.pair_dtype_defines("float64")


# Row blocks (ROW_BLOCK: a launch over the rows [row_begin, row_end)): every LayerNorm
# projection and each attention variant's smallest and largest head dim, with and without
# ROW_MASK (kernel_catalog.row_blocked_configs).
@each_config(gpu.kernel_catalog.row_blocked_configs)
def test_row_blocks_compile_without_spills(config, arch):
    report = _compile_within_spill_allowance(config, arch)
    if config.filename.startswith("project_"):
        assert any(entry.startswith("ln_qkvg_project") for entry in report), report


# project_mma.cu's LN_SPLIT (LayerNorm 2 threads per row, off until measured on a GPU):
# compiled here so that the switch stays buildable, for the 128-row blocks it changes.
@pytest.mark.parametrize("config", [c for c in gpu.kernel_catalog.all_configs("sm_90")
                                    if c.filename == "project_mma.cu"
                                    and dict(c.defines)["BM"] == 128],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.defines))
def test_layernorm_split_compiles_without_new_spills(config):
    log = gpu.compile.compile_offline(config.filename, config.defines + (("LN_SPLIT", 1),),
                                   config.arch or "sm_90")
    allowed = _allowed_spill_bytes(config, "sm_90")
    for entry, usage in gpu.compile.ptxas_report(log).items():
        assert usage["spill_stores"] <= allowed and usage["spill_loads"] <= allowed, (entry, usage)
    assert "C7513" not in log


def test_spills_of_callees_count_for_their_entry():
    log = """ptxas info    : Compiling entry function 'k' for 'sm_90'
ptxas info    : Function properties for k
ptxas         .     16 bytes stack frame, 20 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 16 bytes cumulative stack size
ptxas info    : Function properties for _Z6helperv
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 4 bytes spill loads"""
    assert gpu.compile.ptxas_report(log) == {"k": {"stack": 16, "spill_stores": 20,
                                                "spill_loads": 20, "registers": 128}}


def test_compile_error_points_at_the_file():
    broken = (("HEAD_DIM", "32 +"),)  # a define that breaks the source
    with pytest.raises(gpu.compile.CompileError, match=r"kernels/attention_ffma\.cu"):
        gpu.compile.compile_offline("attention_ffma.cu", broken, "sm_90")


@pytest.mark.parametrize("arch", ["sm_100", "sm_120"])
def test_a_newer_gpu_compiles_its_declared_route(arch):
    """A GPU newer than the table (gpus.gpu's declared row: the 9.0 row less wgmma) runs
    kernels CuPy compiles for its own architecture: the declared route's smallest
    configurations (its attention at head dim 8, its projections at D = 64) compile."""
    route = gpu.routes.choose_route("bf16", 8, 64, 1024, int(arch.removeprefix("sm_")))
    assert route.name == "mma_bf16"
    attention = route.attention_launch(8, 1024).config
    project = gpu.kernel_configs.project_config(64, route.project, 64, route.layout, route.products)
    for config in (attention, project):
        report = gpu.compile.ptxas_report(gpu.compile.compile_offline(
            config.filename, config.defines, arch))
        assert report, config
    assert set(report) == {"ln_qkvg_project_mma_tf32", "gated_out_project_mma_tf32"}


def test_every_supported_dimension_has_a_config():
    configs = set(gpu.kernel_catalog.all_configs())
    for d in gpu.checks.supported_head_dims():
        assert gpu.kernel_configs.attention_config(d) in configs
    rows_fp32 = gpu.layouts.ROWS_FP32
    for D in (4, 64, 128, 320, 324, 768):
        for rows_total in (1, 10**9):
            for engine, products in (("ffma", "fp32"), ("mma", "tf32"), ("mma", "f16x3")):
                rows = gpu.tiles.project_rows(D, rows_total, tensor_cores=engine == "mma")
                for r in (rows, gpu.tiles.out_project_rows()):
                    assert gpu.kernel_configs.project_config(r, engine, D, rows_fp32, products) in configs


def test_every_route_compiles_here():
    """Every configuration each route launches (the default ones over a grid of problems,
    and every forced one) is among those compiled by test_compiles_without_spills."""
    compiled = {arch: set(gpu.kernel_catalog.all_configs(arch)) for arch in ("sm_80", "sm_90")}
    for cc, arch in ((80, "sm_80"), (90, "sm_90")):
        for precision in gpu.checks.PRECISIONS:
            for d, D in ((32, 128), (32, 64), (16, 64), (8, 768), (64, 128), (128, 256)):
                for n in (1, 128, 129, 384, 768, 4096):
                    for force in (None, *gpu.routes.ROUTES):
                        try:
                            route = gpu.routes.choose_route(precision, d, D, n, cc, force=force)
                        except ValueError:
                            continue
                        launch = route.attention_launch(d, n)
                        assert launch.config in compiled[arch], (route, d, n)
                        for engine in {route.project, route.out_project} - {"persistent"}:
                            for rows in {gpu.tiles.project_rows(D, t, tensor_cores=engine == "mma")
                                         for t in (1, 10**9)} | {gpu.tiles.out_project_rows()}:
                                config = gpu.kernel_configs.project_config(rows, engine, D, route.layout,
                                                                   route.products)
                                assert config in compiled[arch], (route, D, rows)
                        if "persistent" in (route.project, route.out_project):
                            assert gpu.kernel_configs.persistent_project_config(route.layout) in compiled[arch]


def test_projection_rows_per_block():
    """128-row blocks wherever they give every SM one (tensor cores) or ~4 (FFMA); 64 rows
    for fewer rows, and for D above 320 (shared memory)."""
    sms = 132
    assert gpu.tiles.project_rows(64, 2 * 128 * 128, sms, tensor_cores=True) == 128
    assert gpu.tiles.project_rows(128, 64 * 64, sms, tensor_cores=True) == 64
    assert gpu.tiles.project_rows(64, 2 * 128 * 128, sms, tensor_cores=False) == 64
    assert gpu.tiles.project_rows(128, 1024 * 1024, sms, tensor_cores=False) == 128
    assert gpu.tiles.project_rows(384, 1024 * 1024, sms, tensor_cores=True) == 64


def test_every_launch_fits_in_shared_memory():
    """Every attention launch the tables pick asks for at most the 227 KiB of dynamic shared
    memory a block may opt into on sm_80/sm_90, and every projection launch too."""
    limit = gpu.tiles.SMEM_LIMIT
    for d in gpu.checks.supported_head_dims():
        for precision in gpu.checks.PRECISIONS:
            for n in (1, 128, 129, 512, 513, 4096):
                launch = gpu.routes.attention_kernel(d, precision, 90, n)
                assert launch.smem <= limit, (d, precision, n, launch)
                assert launch.blocks(1, n, 1) >= 1
    for D in (4, 64, 128, 320, 324, 640, 644, 768):
        for rows_total in (1, 10**9):
            rows = gpu.tiles.project_rows(D, rows_total)
            assert gpu.tiles.project_smem_bytes(D, rows) <= limit, (D, rows)
        assert gpu.tiles.project_smem_bytes(D, gpu.tiles.out_project_rows()) <= limit, D


# MaxSharedMemoryPerBlockOptin of sm_90 (the tables' SMEM_LIMIT), sm_80, and sm_86/89.
SMEM_OPTIN = {"sm_90": 227 * 1024, "sm_80": 163 * 1024, "sm_86": 99 * 1024}


def test_the_sm_90_limit_changes_no_choice():
    """At the H200's own limit the tables pick exactly what they pick by default."""
    limit = SMEM_OPTIN["sm_90"]
    for d in gpu.checks.supported_head_dims():
        for precision in gpu.checks.PRECISIONS:
            for n in (1, 128, 129, 512, 513, 4096):
                assert (gpu.routes.attention_kernel(d, precision, 90, n, limit)
                        == gpu.routes.attention_kernel(d, precision, 90, n))
    for D in range(4, gpu.tiles.MAX_PAIR_DIM + 1, 4):
        gpu.checks.check_projection_fits(D, limit)
        for rows_total in (1, 10**9):
            assert (gpu.tiles.project_rows(D, rows_total, 132, limit)
                    == gpu.tiles.project_rows(D, rows_total, 132))


@pytest.mark.parametrize("gpu_name", ["sm_80", "sm_86"])
def test_smaller_gpus_get_launches_that_fit_or_a_clear_error(gpu_name):
    limit, cc = SMEM_OPTIN[gpu_name], int(gpu_name[3:])
    for d in gpu.checks.supported_head_dims():
        for precision in gpu.checks.PRECISIONS:
            for n in (1, 128, 129, 512, 513, 4096):
                launch = gpu.routes.attention_kernel(d, precision, cc, n, limit)
                assert launch.smem <= limit, (gpu_name, d, precision, n, launch)
    for D in range(4, gpu.tiles.MAX_PAIR_DIM + 1, 4):
        try:
            gpu.checks.check_projection_fits(D, limit, "GPU 0")
        except ValueError as error:
            assert f"pair_dim {D} needs" in str(error) and f"allows {limit}" in str(error)
            assert gpu.tiles.project_smem_bytes(D, 64) > limit
            continue
        for rows_total in (1, 10**9):
            rows = gpu.tiles.project_rows(D, rows_total, 108, limit)
            assert gpu.tiles.project_smem_bytes(D, rows) <= limit, (gpu_name, D, rows)
        assert gpu.tiles.project_smem_bytes(D, gpu.tiles.out_project_rows()) <= limit


def test_which_attention_kernel_each_mode_takes():
    """The wgmma kernels only on compute capability 9.0, at head dim 32, above their N
    thresholds (every mode from N = 129; fp32 as f16x3, tf32 as f16); mma.sync otherwise
    (fp32 as its f16x3 too, which scales q, k, v itself: operand_scales)."""
    def name(d, precision, cc, n):
        return gpu.routes.attention_kernel(d, precision, cc, n).name

    assert name(32, "tf32", 90, 128) == "attention_mma_tf32"
    assert name(32, "tf32", 90, 129) == "attention_wgmma_f16"
    assert name(32, "fp32", 90, 128) == "attention_mma_f16x3"
    assert name(32, "fp32", 90, 129) == "attention_wgmma_f16x3"
    assert name(32, "bf16", 90, 128) == "attention_mma_bf16"
    assert name(32, "bf16", 90, 129) == "attention_wgmma_bf16"
    for cc in (80, 89, 100):  # sm_90a code runs on 9.0 only
        assert name(32, "fp32", cc, 4096) == "attention_mma_f16x3"
        assert name(32, "tf32", cc, 4096) == "attention_mma_tf32"
        assert name(32, "bf16", cc, 4096) == "attention_mma_bf16"
    assert name(64, "fp32", 90, 4096) == "attention_mma_f16x3"
    assert name(16, "fp32", 90, 128) == "attention_mma_f16x3"  # the benchmark's 2x128x64x4
    small = gpu.routes.attention_kernel(16, "fp32", 90, 128)
    assert small.layout == gpu.layouts.ROWS_FP32 and small.operand_scales
    # 3xTF32 stays as f16x3's accuracy oracle, reading the same layout, without scales
    tf32x3 = gpu.kernel_configs.attention_mma_launch(16, "tf32x3", n=128)
    assert tf32x3.name == "attention_mma_tf32x3" and tf32x3.layout == gpu.layouts.ROWS_FP32
    assert not tf32x3.operand_scales
    fp32 = gpu.routes.attention_kernel(32, "fp32", 90, 4096)
    assert fp32.layout == gpu.layouts.TILES_F16_HILO and fp32.smem <= gpu.tiles.SMEM_LIMIT
    bf16 = gpu.routes.attention_kernel(32, "bf16", 90, gpu.routes.F16S_SLOTS_FROM_N - 1)
    assert bf16.layout == gpu.layouts.TILES_BF16 and bf16.smem <= gpu.tiles.SMEM_LIMIT
    # from F16S_SLOTS_FROM_N S in fp16 (on slot rows at D = 128: attention_kernel's)
    for n in (gpu.routes.F16S_SLOTS_FROM_N, 4096):
        bf16 = gpu.routes.attention_kernel(32, "bf16", 90, n)
        assert bf16.name == "attention_wgmma_f16s" and bf16.smem <= gpu.tiles.SMEM_LIMIT
    tf32 = gpu.routes.attention_kernel(32, "tf32", 90, 4096)
    assert tf32.layout == gpu.layouts.TILES_F16 and tf32.smem <= gpu.tiles.SMEM_LIMIT


def test_a_too_small_gpu_falls_back_to_the_ffma_attention():
    launch = gpu.routes.attention_kernel(32, "tf32", 86, 4096, SMEM_OPTIN["sm_86"])
    assert launch.name == "attention_ffma_fp32" and launch.layout == gpu.layouts.ROWS_FP32


# Every wgmma tile shape the tests and sweeps launch, per variant.
_WGMMA_SHAPES = [gpu.tiles.WgmmaTiles(rows, stages, 1, 2)
                 for rows in (1, 2) for stages in (2, 3, 4)]


@pytest.mark.parametrize("variant", list(gpu.tiles.WGMMA_VARIANTS))
def test_wgmma_shared_memory_mirror_matches_the_kernel(variant):
    """gpu.tiles.attention_wgmma_smem_bytes is what the host asks for at launch; the kernel
    lays its shared memory out by its own SMEM_BYTES. A launch given less than the kernel
    uses would read and write past its allocation, silently: compile a static_assert
    that the two agree (PTX only, no ptxas)."""
    checked = 0
    for tiles in _WGMMA_SHAPES:
        try:
            launch = gpu.kernel_configs.attention_wgmma_launch(32, tiles, variant)
        except ValueError:  # a shape the variant does not take
            continue
        compile_ptx_or_fail(gpu.compile.full_source(launch.config.filename, launch.config.defines)
                            + f'\nstatic_assert(SMEM_BYTES == {launch.smem}, "smem mirror: '
                            f'{variant} {tiles}");\n')
        checked += 1
    assert checked >= 3


# Every mma.sync tile shape the tests launch (tests/test_attention_mma.py TILES), and the
# tables' own.
_MMA_SHAPES = [gpu.tiles.MmaTiles(*shape) for shape in
               [(64, 1, 1, 1, 1), (64, 1, 2, 1, 1), (32, 2, 2, 1, 1), (16, 2, 1, 1, 1),
                (64, 1, 2, 0, 1), (32, 1, 1, 0, 2), (32, 1, 1, 1, 2, 2), (32, 1, 1, 1, 3, 2),
                (16, 1, 1, 1, 2, 4), (32, 2, 2, 0, 1)]]


def _check_mma_shared_memory_mirror(variant, shapes):
    """gpu.tiles.attention_mma_smem_bytes, what the host asks for at launch, equals the
    kernel's own SMEM_BYTES (compiled as a static_assert, PTX only), for `variant` at head
    dims on both sides of 16-wide k-steps (d % 16 == 8) and each tile shape of `shapes(d)`."""
    for d in (8, 16, 24, 64):
        if d not in gpu.tiles.attention_mma_head_dims(variant):
            continue
        for tiles in shapes(d):
            launch = gpu.kernel_configs.attention_mma_launch(d, variant, tiles)
            compile_ptx_or_fail(
                gpu.compile.full_source(launch.config.filename, launch.config.defines)
                + f'\nstatic_assert(SMEM_BYTES == {launch.smem}, "smem mirror: {variant} '
                f'd={d} {tiles}");\n', "compute_80")


@pytest.mark.parametrize("variant", list(gpu.kernel_configs.ATTENTION_MMA_VARIANTS))
def test_mma_shared_memory_mirror_matches_the_kernel(variant):
    """The shared memory mirror for the tile tables' shapes: what the routes launch."""
    _check_mma_shared_memory_mirror(variant, lambda d: dict.fromkeys(
        gpu.tiles.attention_mma_tiles(d, variant, n, cc) for n in (128, 129) for cc in (80, 90)))


@pytest.mark.slow  # about 60 s on 2 cores: every listed shape at four head dims
@pytest.mark.parametrize("variant", list(gpu.kernel_configs.ATTENTION_MMA_VARIANTS))
def test_mma_shared_memory_mirror_of_the_tests_tile_shapes(variant):
    """The shared memory mirror for every shape tests/test_attention_mma.py launches on the
    GPU (run it with --run-slow before those)."""
    _check_mma_shared_memory_mirror(variant, lambda d: _MMA_SHAPES)


def test_no_generic_lambdas_in_kernels():
    """A lambda with `auto` parameters compiles with this machine's NVRTC (CUDA 13.5) but
    not with the GPU's (CUDA 13.0: "host function in JIT mode"), so the offline compile
    checks cannot catch it. Kernels use template functions instead."""
    import pathlib
    import re

    # a capture list, then a parameter list (one level of nested parentheses, as in
    # `float (&d)[32]`, across lines) naming `auto`
    generic = re.compile(r"\[[^\]\n]*\]\s*\((?:[^()]|\([^()]*\))*\bauto\b")
    found = [f"{path.name}:{text[:m.start()].count(chr(10)) + 1}"
             for path in sorted(pathlib.Path(gpu.compile._kernels_folder()).glob("*.cu*"))
             for text in [path.read_text()] for m in generic.finditer(text)]
    assert not found, found
    assert generic.search("[&](float (&d)[32],\n     auto x) {")  # the pattern does match

"""The route of a forward: which kernels run, on which layout, with which scales.

`choose_route` is the one place that decides it, from (precision, head dim, D, N, the GPU's
row of gpus.GPUS, the pair's alignment, the shared memory per block, the weights' f16s
scales, whether a mask is given); launch_plan builds the launches from the route and
decides nothing. Tests and tools force a route by name (ROUTES) through `route=` of the
public API.

    route                     precision   GPUs (engines; head dim d, N)               projections + attention
    ffma                      any         FFMA only, or where no other fits           ffma fp32 + ffma fp32
    mma_f16x3                 fp32        mma; d % 8 == 0, d <= 64                    mma f16x3 + mma f16x3
    mma_tf32                  tf32        mma; d % 8 == 0, d <= 120                   mma tf32 + mma tf32
    mma_bf16                  bf16        mma; d % 8 == 0                             mma tf32 + mma bf16
    mma_f16x3_ffma            fp32        mma; other head dims                        mma f16x3 + ffma fp32
    mma_tf32_ffma             tf32, bf16  mma; other head dims                        mma tf32 + ffma fp32
    wgmma_f16x3               fp32        wgmma; d = 32, N > 128, D != 128            mma f16x3 + wgmma f16x3
    wgmma_f16x3_persistent    fp32        wgmma; d = 32, N > 128, D = 128             persistent f16x3 + wgmma f16x3
    wgmma_f16                 tf32        wgmma; d = 32, N > 128, D != 128            mma f16 + wgmma f16
    wgmma_f16_persistent      tf32        wgmma; d = 32, N > 128, D = 128             persistent f16 + wgmma f16
    wgmma_bf16                bf16        wgmma; d = 32, 128 < N < 768, D != 128      mma f16 + wgmma bf16
    wgmma_bf16_persistent     bf16        wgmma; d = 32, 128 < N < 384, D = 128       persistent f16 + wgmma bf16
    wgmma_f16s                bf16        wgmma; d = 32, N >= 768, D != 128           mma f16 + wgmma f16s
    wgmma_f16s_persistent     bf16        wgmma; d = 32, N >= 768, D = 128, rows unaligned   mma f16 + wgmma f16s, out persistent
    wgmma_f16s_slots          bf16        wgmma; d = 32, N >= 384, D = 128            persistent f16 + wgmma f16s (slot rows)

A route is named engine_arithmetic (ARITHMETIC below says what each arithmetic word
computes): the arithmetic is what runs, the precision mode what the caller asks for. So
the bf16 mode's wgmma routes run fp16 projections (f16, q, k and v scaled into fp16's
range) with the bf16 attention, or the f16s one; its mma.sync routes TF32 projections. The
"_persistent" routes run the persistent projections (project_wgmma.cu,
project_wgmma_split.cu: one block per SM, the weights resident) for the out projection,
and for the LayerNorm projection where the pair's rows are 16-byte aligned (it copies
whole rows); project_mma.cu otherwise. The forward reads a pair whose rows are not
contiguous and 16-byte aligned from an aligned copy (gpu/forward.py), so the bits never
depend on an array's address: the unaligned variants (wgmma_f16s_persistent, and the
"_persistent" routes' project_mma.cu projection) run only where a route is forced. Where
the weights' scores could leave fp16's range (scales.f16s_scales is None), the f16s
routes give way to the bf16 ones. `mma_tf32x3` (fp32: 3xTF32 attention) is taken by no
GPU: it stays as the accuracy oracle of the f16x3 attention (tests/test_attention_mma.py).
"""
from __future__ import annotations

import dataclasses

from . import gpus, layouts, tuned_tiles
from .checks import check_precision
from .kernel_configs import (WGMMA_LAYOUTS, AttentionLaunch, attention_ffma_launch,
                             attention_mma_launch, attention_wgmma_launch, persistent_fits)
from .layouts import Layout
from .tiles import (SMEM_LIMIT, PERSISTENT_PAIR_DIM, WGMMA_HEAD_DIMS, attention_mma_head_dims,
                    attention_mma_smem_bytes, attention_smem_bytes)
from .tuned_tiles import SMALL_N


# N above which head dim 32 takes the wgmma attention on compute capability 9.0, in every
# mode (faster from N = 129: TF32 1x384 / 1x1024 0.179 / 2.50 against 0.198 / 3.00 ms on
# mma.sync; fp32 1x160 0.265 against 0.278, 1x256 0.499 / 0.570; below N = 128 equal
# within noise).
WGMMA_ABOVE_N = SMALL_N
# The bf16 mode's f16s attention (S in fp16 accumulators) from these N: from
# F16S_SLOTS_FROM_N on the slot rows project_wgmma.cu writes (1x1024 2.87 -> 2.73 ms
# against the fp16 tiles' rows of 2D words, 1x384 0.294 -> 0.282 against the bf16
# attention), else from F16S_FROM_N (its projections cost more than its attention gains
# below: a cubic gain against a quadratic cost fitted to 1x384 and 1x1024 breaks even near
# N = 730).
F16S_FROM_N = 768
F16S_SLOTS_FROM_N = 384
# N from which a masked forward finds each batch's key extent, so that the attention's key
# loops stop at the last key tile any query keeps (exact: the tiles past it are masked for
# every query). Below it a trailing masked tile is too small a share to pay for the
# memset and the launch (2x128x64x4 is host-bound).
KEY_EXTENT_MIN_N = 512

# What each arithmetic word of a route, a kernel entry point or Route.products means
ARITHMETIC = {
    "fp32": "fp32 FMA",
    "tf32": "TF32 products, fp32 sums",
    "tf32x3": "3xTF32: TF32 hi + lo products, fp32-accurate",
    "bf16": "bf16 products, fp32 sums",
    "f16": "fp16 products of operands scaled into fp16's range, fp32 sums",
    "f16x3": "fp16 hi + lo products of scaled operands, fp32-accurate",
    "f16s": "f16 with the scores summed in fp16 accumulators",
}


@dataclasses.dataclass(frozen=True)
class Route:
    """Every choice of a forward (the module docstring's table):

    project, out_project: the LayerNorm + q/k/v/gate/bias projection's and the gated out
        projection's engine: "ffma" (project_ffma.cu), "mma" (project_mma.cu) or
        "persistent" (the persistent projections, project_wgmma.cu / project_wgmma_split.cu);
    products: the projections' arithmetic (ARITHMETIC): "fp32", "tf32", "f16", "f16x3";
    attention: "ffma", "mma_<arithmetic>" or "wgmma_<arithmetic>" (attention_ffma.cu,
        attention_mma.cu, attention_wgmma.cu; as their entry points);
    layout: how the projection stores q, k, v, the gate and the bias (layouts.py);
    scales: the powers of two q, k, v and the bias come scaled by (DeviceWeights.qkv_scales:
        "f16x3", "f16_biased", "f16s"), or None;
    tile_table: the tile table (tuned_tiles.TABLES) that shapes the mma.sync attention;
    key_extent: each batch's last kept key found first (masked forwards from
        KEY_EXTENT_MIN_N)."""
    name: str
    project: str
    out_project: str
    products: str
    attention: str
    layout: Layout
    scales: str | None = None
    tile_table: str = "sm_90"
    key_extent: bool = False

    def attention_launch(self, head_dim: int, n: int) -> AttentionLaunch:
        """The attention kernel of this route for `head_dim` and `n` keys."""
        engine, _, variant = self.attention.partition("_")
        if engine == "ffma":
            return attention_ffma_launch(head_dim)
        if engine == "mma":
            return attention_mma_launch(head_dim, variant, n=n,
                                        tiles=tuned_tiles.mma_tiles(self.tile_table,
                                                                    head_dim, variant, n))
        return attention_wgmma_launch(head_dim, variant=variant,
                                      slot_rows=self.layout == layouts.TILES_F16_SLOTS)


@dataclasses.dataclass(frozen=True)
class RouteRow:
    """A row of the route table: the `precisions` it serves, the projections' `engine`
    ("ffma", "mma", "persistent": the LayerNorm projection "mma" where the pair's rows are
    unaligned) and arithmetic (`products`), the `attention`, the `layout` and `scales`
    (as Route's)."""
    precisions: tuple[str, ...]
    engine: str
    products: str
    attention: str
    layout: Layout
    scales: str | None = None

    @property
    def engines(self) -> tuple[str, ...]:
        """The GPU engines (gpus.py) the route's kernels need."""
        attention = self.attention.partition("_")[0]
        projection = gpus.WGMMA if self.engine == "persistent" else self.engine
        return tuple(dict.fromkeys((projection, attention)))


_ANY = ("fp32", "tf32", "bf16")
ROUTE_TABLE = {
    "ffma": RouteRow(_ANY, "ffma", "fp32", "ffma", layouts.ROWS_FP32),
    "mma_f16x3": RouteRow(("fp32",), "mma", "f16x3", "mma_f16x3", layouts.ROWS_FP32),
    "mma_tf32": RouteRow(("tf32",), "mma", "tf32", "mma_tf32", layouts.ROWS_TF32),
    "mma_bf16": RouteRow(("bf16",), "mma", "tf32", "mma_bf16", layouts.ROWS_BF16),
    "mma_f16x3_ffma": RouteRow(("fp32",), "mma", "f16x3", "ffma", layouts.ROWS_FP32),
    "mma_tf32_ffma": RouteRow(("tf32", "bf16"), "mma", "tf32", "ffma", layouts.ROWS_FP32),
    "wgmma_f16x3": RouteRow(("fp32",), "mma", "f16x3", "wgmma_f16x3",
                            layouts.TILES_F16_HILO, "f16x3"),
    "wgmma_f16x3_persistent": RouteRow(("fp32",), "persistent", "f16x3", "wgmma_f16x3",
                                       layouts.TILES_F16_HILO, "f16x3"),
    "wgmma_f16": RouteRow(("tf32",), "mma", "f16", "wgmma_f16", layouts.TILES_F16,
                          "f16_biased"),
    "wgmma_f16_persistent": RouteRow(("tf32",), "persistent", "f16", "wgmma_f16",
                                     layouts.TILES_F16, "f16_biased"),
    "wgmma_bf16": RouteRow(("bf16",), "mma", "f16", "wgmma_bf16", layouts.TILES_BF16),
    "wgmma_bf16_persistent": RouteRow(("bf16",), "persistent", "f16", "wgmma_bf16",
                                      layouts.TILES_BF16),
    "wgmma_f16s": RouteRow(("bf16",), "mma", "f16", "wgmma_f16s", layouts.TILES_F16, "f16s"),
    "wgmma_f16s_persistent": RouteRow(("bf16",), "persistent", "f16", "wgmma_f16s",
                                      layouts.TILES_F16, "f16s"),
    "wgmma_f16s_slots": RouteRow(("bf16",), "persistent", "f16", "wgmma_f16s",
                                 layouts.TILES_F16_SLOTS, "f16s"),
    # the accuracy oracle of the f16x3 attention, taken by no GPU
    "mma_tf32x3": RouteRow(("fp32",), "mma", "f16x3", "mma_tf32x3", layouts.ROWS_FP32),
}
ROUTES = tuple(ROUTE_TABLE)

# The attention arithmetic of each precision mode on each tensor-core engine
_MMA_ARITHMETIC = {"fp32": "f16x3", "tf32": "tf32", "bf16": "bf16"}
_WGMMA_ARITHMETIC = {"fp32": "f16x3", "tf32": "f16", "bf16": "bf16"}


def route_parts(name: str) -> dict:
    """The parts of the route `name` (ROUTES) as a dictionary, for tables and tools."""
    row = ROUTE_TABLE[name]
    return {"precisions": row.precisions, "project": row.engine, "out_project": row.engine,
            "products": row.products, "attention": row.attention, "layout": row.layout.name,
            "scales": row.scales}


def _default_route_name(precision: str, head_dim: int, pair_dim: int, n: int,
                        gpu: gpus.Gpu, rows_aligned: bool, smem_limit: int,
                        f16s_scales: bool) -> str:
    """The fastest route a GPU of row `gpu` takes (the module docstring)."""
    if not gpu.runs(gpus.MMA):
        return "ffma"
    if gpu.runs(gpus.WGMMA) and head_dim in WGMMA_HEAD_DIMS and n > WGMMA_ABOVE_N:
        variant = _WGMMA_ARITHMETIC[precision]
        # (slot rows: from project_wgmma.cu only, whose LayerNorm projection needs them aligned)
        slots = rows_aligned and persistent_fits(layouts.TILES_F16_SLOTS, pair_dim, smem_limit)
        if precision == "bf16" and f16s_scales and n >= (F16S_SLOTS_FROM_N if slots
                                                         else F16S_FROM_N):
            variant = "f16s"
        if attention_wgmma_launch(head_dim, variant=variant).smem <= smem_limit:
            if variant == "f16s" and slots:
                return "wgmma_f16s_slots"
            persistent = persistent_fits(WGMMA_LAYOUTS[variant], pair_dim, smem_limit)
            return f"wgmma_{variant}" + ("_persistent" if persistent else "")
    mma = _MMA_ARITHMETIC[precision]
    if head_dim in attention_mma_head_dims(mma):
        tiles = tuned_tiles.mma_tiles(gpu.tile_table, head_dim, mma, n)
        if attention_mma_smem_bytes(head_dim, mma, tiles) <= smem_limit:
            return f"mma_{mma}"
    return "mma_f16x3_ffma" if precision == "fp32" else "mma_tf32_ffma"


def choose_route(precision: str, head_dim: int, pair_dim: int, n: int,
                 compute_capability: int, *, rows_aligned: bool = True,
                 smem_limit: int = SMEM_LIMIT, f16s_scales: bool = True,
                 masked: bool = False, force: "Route | str | None" = None) -> Route:
    """The route of a forward: `precision`, head dim, pair dim D, N on a GPU of
    `compute_capability` (its row of gpus.GPUS) allowing `smem_limit` bytes of shared
    memory per block; rows_aligned: the pair's rows are contiguous and 16-byte aligned (the
    persistent LayerNorm projection copies whole rows); f16s_scales: the weights admit the
    f16s attention's scales (scales.f16s_scales); masked: a mask is given.
    `force`: a route name (ROUTES), optionally with "@" and a tile table (tuned_tiles.TABLES:
    "@sm_80"), or a Route to take instead of the fastest; a route the problem cannot take
    is a ValueError naming what is missing."""
    check_precision(precision)
    if isinstance(force, Route):
        return force
    gpu = gpus.gpu(compute_capability)
    tile_table, suffix = gpu.tile_table, ""
    if force is None:
        name = _default_route_name(precision, head_dim, pair_dim, n, gpu, rows_aligned,
                                   smem_limit, f16s_scales)
    elif isinstance(force, str):
        name, at, table = force.partition("@")
        if name not in ROUTE_TABLE or (at and table not in tuned_tiles.TABLES):
            tables = " or ".join(f"'@{t}'" for t in sorted(tuned_tiles.TABLES))
            raise ValueError(f"route must be a Route or one of {ROUTES}, optionally with "
                             f"{tables} (the mma attention's tile table); got {force!r}")
        _check_forced(name, precision, head_dim, pair_dim, gpu, smem_limit, f16s_scales)
        if at:
            tile_table, suffix = table, at + table
    else:
        raise TypeError(f"route must be a Route, a route name or None; got "
                        f"{type(force).__name__}")
    row = ROUTE_TABLE[name]
    project = "mma" if row.engine == "persistent" and not rows_aligned else row.engine
    if row.attention == "ffma" and attention_smem_bytes(head_dim) > smem_limit:
        raise ValueError(f"head dim {head_dim} needs {attention_smem_bytes(head_dim)} bytes of "
                         f"shared memory per block for the attention; this GPU allows "
                         f"{smem_limit}")
    return Route(name + suffix, project, row.engine, row.products, row.attention,
                 row.layout, row.scales, tile_table, masked and n >= KEY_EXTENT_MIN_N)


def route_for_attention(launch: AttentionLaunch, precision: str, pair_dim: int, n: int,
                        compute_capability: int, *, rows_aligned: bool = True,
                        smem_limit: int = SMEM_LIMIT, masked: bool = False) -> Route:
    """The route around a given attention `launch` (tile sweeps and tests of one kernel):
    the projections the default routes pair with its layout, in `precision`'s arithmetic."""
    check_precision(precision)
    gpu = gpus.gpu(compute_capability)
    attention = launch.name.removeprefix("attention_")  # engine_arithmetic
    if attention.startswith("ffma"):
        attention = "ffma"
    layout = launch.layout
    if not gpu.runs(gpus.MMA):
        project, products = "ffma", "fp32"
    else:
        project = "mma"
        products = "f16x3" if precision == "fp32" else "f16" if layout.tiled else "tf32"
    out_project = project
    if (project == "mma" and gpu.runs(gpus.WGMMA)
            and persistent_fits(layout, pair_dim, smem_limit)):
        out_project = "persistent"
        project = "persistent" if rows_aligned else "mma"
    scales = ("f16s" if attention == "wgmma_f16s"
              else {layouts.TILES_F16_HILO: "f16x3", layouts.TILES_F16: "f16_biased"}.get(layout))
    return Route(f"{project}+{attention}", project, out_project, products, attention, layout,
                 scales, gpu.tile_table, masked and n >= KEY_EXTENT_MIN_N)


def _check_forced(name, precision, head_dim, pair_dim, gpu: gpus.Gpu, smem_limit,
                  f16s_scales):
    row = ROUTE_TABLE[name]
    if precision not in row.precisions:
        raise ValueError(f"route {name!r} serves precision {' or '.join(row.precisions)}; "
                         f"got {precision!r}")
    engine, _, variant = row.attention.partition("_")
    capability = f"this GPU has {gpu.compute_capability / 10:.1f}"
    if engine != "ffma" and not gpu.runs(gpus.MMA):
        raise ValueError(f"route {name!r} needs compute capability 8.0 or newer (tensor "
                         f"cores); {capability}")
    if engine == "mma" and head_dim not in attention_mma_head_dims(variant):
        raise ValueError(f"route {name!r} takes head dims {attention_mma_head_dims(variant)}; "
                         f"got {head_dim}")
    if gpus.WGMMA in row.engines and not gpu.runs(gpus.WGMMA):
        raise ValueError(f"route {name!r} needs compute capability 9.0 (wgmma); {capability}")
    if engine == "wgmma" and head_dim not in WGMMA_HEAD_DIMS:
        raise ValueError(f"route {name!r} takes head dims {WGMMA_HEAD_DIMS}; got {head_dim}")
    if row.engine == "persistent" and not persistent_fits(row.layout, pair_dim, smem_limit):
        raise ValueError(f"route {name!r} needs pair_dim {PERSISTENT_PAIR_DIM} (the persistent "
                         f"projections); got {pair_dim}")
    if row.scales == "f16s" and not f16s_scales:
        raise ValueError(f"route {name!r} needs these weights' scores inside fp16's range "
                         f"(scales.f16s_scales: their bound passes 2^15 in log2 units)")


def attention_kernel(head_dim: int, precision: str, compute_capability: int = 90,
                     n: int = 1 << 30, smem_limit: int | None = None) -> AttentionLaunch:
    """The attention kernel the default route takes (for tables and tests), or a clear
    error where even the FFMA kernel's tiles do not fit."""
    limit = SMEM_LIMIT if smem_limit is None else smem_limit
    route = choose_route(precision, head_dim, PERSISTENT_PAIR_DIM, n, compute_capability,
                         smem_limit=limit)
    launch = route.attention_launch(head_dim, n)
    if launch.smem > limit:
        raise ValueError(f"head dim {head_dim} needs {launch.smem} bytes of shared memory per "
                         f"block for the attention; this GPU allows {limit}")
    return launch

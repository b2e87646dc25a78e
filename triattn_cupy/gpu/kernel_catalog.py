"""The kernel catalogue: every kernel configuration the routes can launch on the GPUs each
compile target checks (gpus.GPUS rows by check_arch), and what each feature adds to them (OUT_TRANSPOSED, the 16-bit pair types,
ROW_MASK, ROW_BLOCK and the bias passes). The offline compile checks
(tests/test_kernels_compile.py) and tools/compare_kernels.py compile these lists; the
run time builds each configuration it launches through gpu/kernel_configs.py alone.
"""
from __future__ import annotations

from . import gpus, layouts, tuned_tiles
from .checks import supported_head_dims
from .checks import PAIR_DTYPES
from .kernel_configs import (ATTENTION_MMA_VARIANTS, attention_config, attention_mma_config,
                             attention_wgmma_launch, bias_only, key_extent_config,
                             layernorm_bias_config, out_transposed, persistent_project_config,
                             project_config, row_blocked, row_mask_config, row_masked,
                             with_pair_dtype)
from .tiles import (MAX_PAIR_DIM, PERSISTENT_PAIR_DIM, WGMMA_HEAD_DIMS, WGMMA_VARIANTS,
                    attention_mma_head_dims, out_project_rows, project_rows)
from .tuned_tiles import SMALL_N


def _wgmma(arch: str | None) -> bool:
    """Whether a GPU that `arch` checks (None: any) runs the wgmma kernels."""
    return any(g.runs(gpus.WGMMA) for g in gpus.check_arch(arch))


def _tile_tables(arch: str | None) -> set:
    """The mma.sync tile tables of the GPUs that `arch` checks (None: every one)."""
    return {g.tile_table for g in gpus.check_arch(arch)}


def transposed_out_configs(arch: str | None = None):
    """One out projection configuration per kernel file with OUT_TRANSPOSED (what the
    ending node adds to all_configs' kernels; the feature is the same store in each)."""
    D = 128
    configs = [out_transposed(project_config(out_project_rows(), engine, D, layout,
                                             products))
               for engine, layout, products in (("ffma", layouts.ROWS_FP32, "fp32"),
                                                ("mma", layouts.ROWS_FP32, "f16x3"),
                                                ("mma", layouts.ROWS_TF32, "tf32"),
                                                ("mma", layouts.ROWS_BF16, "tf32"))]
    if _wgmma(arch):
        configs += [out_transposed(project_config(out_project_rows(), "mma", D,
                                                  layouts.TILES_F16, "f16"))]
        configs += [out_transposed(persistent_project_config(layout))
                    for layout in (layouts.TILES_F16, layouts.TILES_F16_HILO)]
    return configs


def pair_dtype_configs(arch: str | None = None):
    """The 16-bit pair's projection configurations: per route's projection kernels (an
    engine, layout and products, or the persistent projections of a tiled layout) and
    16-bit type, the smallest (D = 128, the out projection's rows), half of them with
    OUT_TRANSPOSED (the feature's store is the one line each kernel file changes)."""
    parts = [("ffma", layouts.ROWS_FP32, "fp32"), ("mma", layouts.ROWS_FP32, "f16x3"),
             ("mma", layouts.ROWS_TF32, "tf32"), ("mma", layouts.ROWS_BF16, "tf32"),
             ("mma", layouts.ROWS_FP32, "tf32")]
    tiled = []
    if _wgmma(arch):
        parts += [("mma", layouts.TILES_F16_HILO, "f16x3"), ("mma", layouts.TILES_F16, "f16"),
                  ("mma", layouts.TILES_BF16, "f16")]
        tiled = [layout for layout in layouts.LAYOUTS if layout.tiled]
    configs = [project_config(out_project_rows(), engine, PERSISTENT_PAIR_DIM, layout, products)
               for engine, layout, products in parts]
    configs += [persistent_project_config(layout) for layout in tiled]
    return [with_pair_dtype(out_transposed(c) if (n + k) % 2 else c, dtype)
            for n, c in enumerate(configs) for k, dtype in enumerate(PAIR_DTYPES[1:])]


def row_masked_configs(arch: str | None = None, every: bool = False):
    """row_mask_pack and the attention configurations of all_configs with ROW_MASK: each
    variant's (kernel file and arithmetic) smallest and largest head dim, or `every` one."""
    return [row_mask_config()] + [row_masked(c) for c in _attention_variants(arch, every)]


def _attention_variants(arch: str | None, every: bool = False):
    """The attention configurations of all_configs: each variant's (kernel file and
    arithmetic) smallest and largest head dim, or `every` one."""
    attention = [c for c in all_configs(arch) if c.filename.startswith("attention_")]
    if not every:
        variants: dict = {}
        for c in attention:
            defines = dict(c.defines)
            shape = ("HEAD_DIM", "BQ", "BK", "MT", "ROWS", "STAGES", "MIN_BLOCKS", "PREFETCH",
                     "PV_GROUPS")
            variant = (c.filename, c.arch, tuple(sorted((k, v) for k, v in defines.items()
                                                         if k not in shape)))
            variants.setdefault(variant, []).append(c)
        attention = {min(group, key=lambda c: dict(c.defines)["HEAD_DIM"])
                     for group in variants.values()}
        attention |= {max(group, key=lambda c: dict(c.defines)["HEAD_DIM"])
                      for group in variants.values()}
        attention = sorted(attention, key=lambda c: (c.filename, c.defines, c.arch))
    return attention


def row_blocked_configs(arch: str | None = None):
    """What row blocks add to all_configs' kernels: each projection configuration and each
    attention variant's smallest and largest head dim with ROW_BLOCK, the attentions also
    with ROW_MASK (row_masked), the project_mma.cu and project_ffma.cu ones also with
    BIAS_ONLY (the bias pass, of the persistent projections' layouts too)."""
    projections = [c for c in all_configs(arch) if c.filename.startswith("project_")]
    attention = _attention_variants(arch)
    blocked = [row_blocked(c) for c in projections + attention
               + [row_masked(c) for c in attention]]
    return blocked + [bias_only(c) for c in blocked
                      if c.filename in ("project_mma.cu", "project_ffma.cu")] + [
        layernorm_bias_config(layout, PERSISTENT_PAIR_DIM, PERSISTENT_PAIR_DIM // 32, pair_dtype)
        for layout in (layouts.TILES_F16, layouts.TILES_F16_HILO, layouts.TILES_BF16)
        for pair_dtype in PAIR_DTYPES]


def all_configs(arch: str | None = None):
    """Every configuration a supported (pair_dim, num_heads) can launch on the GPUs `arch`
    checks (gpus.CHECK_ARCHS: "sm_80" for 8.x, "sm_90" for 9.0; None: every one), over
    every route."""
    rows_of = {D: {project_rows(D, total) for total in (1, 1 << 62)}
               for D in (128, MAX_PAIR_DIM)}
    parts = {("ffma", layouts.ROWS_FP32, "fp32"), ("mma", layouts.ROWS_FP32, "f16x3"),
             ("mma", layouts.ROWS_TF32, "tf32"), ("mma", layouts.ROWS_BF16, "tf32"),
             ("mma", layouts.ROWS_FP32, "tf32")}
    if _wgmma(arch):  # the projections that write tiles feed the sm_90a attention only
        parts |= {("mma", layouts.TILES_F16_HILO, "f16x3"), ("mma", layouts.TILES_F16, "f16"),
                  ("mma", layouts.TILES_BF16, "f16")}
    configs = {project_config(rows, engine, D, layout, products)
               for engine, layout, products in parts for D in rows_of for rows in rows_of[D]}
    configs.add(key_extent_config())
    configs.update(attention_config(d) for d in supported_head_dims())
    configs.update(attention_mma_config(d, v, tuned_tiles.mma_tiles(table, d, v, n))
                   for v in ATTENTION_MMA_VARIANTS for d in attention_mma_head_dims(v)
                   for n in (SMALL_N, SMALL_N + 1) for table in _tile_tables(arch))
    if _wgmma(arch):
        configs.update(attention_wgmma_launch(d, variant=v).config for d in WGMMA_HEAD_DIMS
                       for v in WGMMA_VARIANTS)
        configs.update(attention_wgmma_launch(d, variant="f16s", slot_rows=True).config
                       for d in WGMMA_HEAD_DIMS)
        configs.update(persistent_project_config(layout) for layout in layouts.LAYOUTS
                       if layout.tiled)
    return sorted(configs, key=lambda c: (c.filename, c.defines, c.arch))

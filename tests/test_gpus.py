"""The GPU table (gpu/gpus.py) and the tuned tiles as data (gpu/tuned_tiles.py): the routes
each compute capability takes, the declared row of one the table does not list, offline."""
from __future__ import annotations

import logging

import pytest

from triattn_cupy import gpu

gpus, routes, tuned_tiles = gpu.gpus, gpu.routes, gpu.tuned_tiles


def test_every_row_names_its_engines_tiles_and_compile_target():
    for cc, row in gpus.GPUS.items():
        assert row.compute_capability == cc and not row.declared
        assert row.engines[0] == gpus.FFMA and set(row.engines) <= {gpus.FFMA, gpus.MMA,
                                                                     gpus.WGMMA}
        assert row.tile_table in tuned_tiles.TABLES and row.check_arch in gpus.CHECK_ARCHS
        assert 48 * 1024 <= row.smem_optin <= gpu.tiles.SMEM_LIMIT
    assert gpus.CHECK_ARCHS == ("sm_80", "sm_90")
    assert [cc for cc, row in gpus.GPUS.items() if row.runs(gpus.WGMMA)] == [90]


def test_tile_tables_name_the_gpu_they_were_tuned_on():
    for name, table in tuned_tiles.TABLES.items():
        assert table.tuned_on.startswith("NVIDIA ") and table.check_arch == name
    assert set(tuned_tiles.TABLES["sm_90"].wgmma) == set(gpu.tiles.WGMMA_VARIANTS)
    with pytest.raises(ValueError, match="takes head dims up to 64; got 72"):
        tuned_tiles.mma_tiles("sm_90", 72, "f16x3", 1024)


@pytest.mark.parametrize("cc", [100, 103, 120, 121])
def test_a_newer_gpu_takes_the_declared_row_with_one_log_line(cc, caplog):
    """An sm_100 or sm_120 GPU runs the 9.0 row less wgmma (sm_90a only): the mma.sync
    routes with the sm_90 tiles, and says so once."""
    gpus.gpu.cache_clear()
    with caplog.at_level(logging.INFO, logger="triattn_cupy"):
        row = gpus.gpu(cc)
        assert gpus.gpu(cc) is row  # (asked again: no second line)
    lines = [r.getMessage() for r in caplog.records if r.name == "triattn_cupy"]
    assert lines == [f"compute capability {cc / 10:.1f} is not in triattn_cupy's GPU "
                     f"table: it takes the 9.0 row's ffma and mma kernels and tiles"]
    assert row.declared and row.engines == (gpus.FFMA, gpus.MMA)
    assert row.tile_table == "sm_90" and row.check_arch == "sm_90"
    for precision, mma in (("fp32", "mma_f16x3"), ("tf32", "mma_tf32"), ("bf16", "mma_bf16")):
        route = routes.choose_route(precision, 32, 128, 1024, cc)
        assert (route.name, route.project, route.tile_table) == (mma, "mma", "sm_90")
    with pytest.raises(ValueError, match="needs compute capability 9.0 \\(wgmma\\)"):
        routes.choose_route("bf16", 32, 128, 1024, cc, force="wgmma_bf16_persistent")


def test_older_and_unlisted_gpus_take_declared_rows():
    assert gpus.gpu(75).engines == (gpus.FFMA,) and gpus.gpu(75).declared
    assert routes.choose_route("bf16", 32, 128, 1024, 75).name == "ffma"
    between = gpus.gpu(88)  # not listed: the newest row below it (8.7)
    assert between.engines == gpus.GPUS[87].engines and between.tile_table == "sm_80"
    assert routes.choose_route("tf32", 32, 128, 1024, 88).tile_table == "sm_80"


def test_route_rows_name_the_engines_they_need():
    assert routes.ROUTE_TABLE["wgmma_f16x3_persistent"].engines == (gpus.WGMMA,)
    assert routes.ROUTE_TABLE["wgmma_bf16"].engines == (gpus.MMA, gpus.WGMMA)
    assert routes.ROUTE_TABLE["mma_tf32_ffma"].engines == (gpus.MMA, gpus.FFMA)
    for row in routes.ROUTE_TABLE.values():
        assert row.products in routes.ARITHMETIC
        assert row.attention == "ffma" or row.attention.split("_")[1] in routes.ARITHMETIC


def test_programmatic_dependent_launches_from_the_table():
    """Captured forwards launch dependents programmatically where the row says the GPU
    runs them (9.0, and the newer GPUs that take its row); never before."""
    assert [cc for cc, row in gpus.GPUS.items() if row.dependent_launches] == [90]
    assert gpus.gpu(120).dependent_launches and not gpus.gpu(75).dependent_launches
    assert not gpu.dependent_launch.supported(86)  # (no driver asked)

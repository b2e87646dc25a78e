"""The developer tools' parsers, on small made-up inputs (no GPU, no ncu)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib

import pytest

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ncu's source page as `--page source --csv --print-source sass` writes it: per kernel a
# "Kernel Name" line, then a table; the samples of a reason without a column of its own
# (here 6 of the HGMMA's 10) are only in the total.
SOURCE_PAGE = """\
"Kernel Name","kernel_a",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"
"0x10","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R16+URZ+0xc800], R17","0","8","0","0","0"
"0x20","@!P0  BRA 0x90","30","8","29","1","5"
"0x30","HGMMA.64x64x16.F16 R44, gdesc[UR20], R44","10","8","0","4","0"
"Kernel Name","kernel_b",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"
"0x10","MUFU.EX2 R1, R2","1,000","64","0","1,000","0"
"""


def test_stalls_reads_each_kernel_of_a_source_page(tmp_path, capsys):
    path = tmp_path / "sass.csv"
    path.write_text(SOURCE_PAGE)
    _tool("profile_kernels").stalls(str(path))
    out = capsys.readouterr().out
    a, b = out.split("kernel_b")
    assert "kernel_a: 3 instructions, 40 stall samples" in a
    assert "long_sb 72.5%" in a and "unnamed 15.0%" in a and "wait 12.5%" in a
    # the busiest instruction first, with the one before it (the mbarrier try-wait)
    rows = [line for line in a.splitlines() if line.startswith("| 7")]
    assert rows and "`@!P0 BRA 0x90`" in rows[0] and "TRYWAIT" in rows[0]
    assert ": 1 instructions, 1000 stall samples" in b and "wait 100.0%" in b
    # per trip of the loop whose count carries the most executions: 8 each
    assert "(8 trips, the set-up shared out): 3.0 instructions; SYNCS 1.0, BRA 1.0, HGMMA 1.0" in a


def test_stalls_names_a_file_without_a_source_page(tmp_path):
    path = tmp_path / "details.csv"
    path.write_text('"ID","Kernel Name"\n"0","k"\n')
    with pytest.raises(SystemExit, match="no ncu source page"):
        _tool("profile_kernels").stalls(str(path))


def test_ab_attention_variants_name_known_switches():
    ab = _tool("ab_attention")
    known = ab.kernel_switches()
    assert {"STAGES", "MIN_BLOCKS", "ROWS"} <= known
    assert ab.parse_variant("s3:STAGES=3,MIN_BLOCKS=2", known) == (
        "s3", (("STAGES", 3), ("MIN_BLOCKS", 2)))
    for bad, why in (("STAGES=3", "NAME:SWITCH"), ("base:STAGES=3", "not 'base'"),
                     ("s3:STAGES", "SWITCH=INTEGER"), ("s3:STAGES=x", "SWITCH=INTEGER"),
                     ("s3:NO_SUCH_SWITCH=1", "no switch 'NO_SUCH_SWITCH'")):
        with pytest.raises(ValueError, match=why):
            ab.parse_variant(bad, known)


def test_ab_attention_builds_each_variant_with_its_defines():
    pytest.importorskip("cupy")
    ab = _tool("ab_attention")
    variants = ab.Variants({"s3": (("STAGES", 3), ("MIN_BLOCKS", 2))})
    try:
        base = variants.attention_config("base", "bf16", "1x1024x128x4", False)
        s3 = variants.attention_config("s3", "bf16", "1x1024x128x4", True)
    finally:
        variants.restore()
    assert base.filename == s3.filename == "attention_wgmma.cu"
    assert s3.defines == base.defines + (("STAGES", 3), ("MIN_BLOCKS", 2), ("ROW_BLOCK", 1))
    from triattn_cupy.gpu import routes
    assert routes.attention_wgmma_launch is variants._launch  # restored


@pytest.mark.parametrize("undo", ["out-rows", "dependents", "both"])
def test_ab_captured_base_undoes_only_what_it_names(undo):
    """tools/ab_captured.py: base's choices are the package's with `undo`'s replaced (64-row
    out blocks; no programmatic dependents), the rest the package's own."""
    from triattn_cupy.gpu import dependent_launch, tiles

    ab = _tool("ab_captured")
    chosen, rows = ab.base_choices(undo, dependent_launch, tiles)
    small = 2 * 128 * 128
    assert rows(small, 132) == (64 if undo != "dependents" else tiles.out_project_rows(small, 132))
    if undo == "out-rows":
        assert chosen is dependent_launch.chosen
    else:
        assert chosen(90, small) is False
    assert tiles.out_project_rows(small, 132) == 128  # (the package's own, untouched)


def test_slim_venv_takes_the_extra_and_the_tests_from_setup_cfg():
    """tools/slim_venv.py: the package's requirements, the slim extra's and the test
    extra's, torch left out (its CUDA builds bring NVIDIA libraries of their own)."""
    slim = _tool("slim_venv")
    requirements = slim.extra_requirements("cuda13-slim")
    assert {"cupy-cuda13x>=14", "cuda-toolkit[nvrtc,cudart]==13.*", "numpy>=1.22",
            "h5py>=3.0", "pytest>=7"} <= set(requirements), requirements
    assert not [r for r in requirements if r.startswith("torch")], requirements
    with pytest.raises(SystemExit, match="setup.cfg has no extra 'cuda14-slim'"):
        slim.extra_requirements("cuda14-slim")


def test_slim_venv_follows_requirements_and_their_extras():
    slim = _tool("slim_venv")
    names = {d.metadata["Name"].lower() for d in slim.closure(["pytest"])}
    assert {"pytest", "pluggy", "iniconfig"} <= names and "numpy" not in names, names
    with pytest.raises(SystemExit, match="no-such-dist is needed but not installed here"):
        slim.closure(["no-such-dist"])
    try:  # cuda-toolkit's extras name its wheels: only those asked for are followed
        cuda = {d.metadata["Name"] for d in slim.closure(["cuda-toolkit[nvrtc]"])}
    except SystemExit:
        pytest.skip("cuda-toolkit[nvrtc] is not installed here")
    assert cuda == {"cuda-toolkit", "nvidia-cuda-nvrtc"}, cuda


def test_slim_venv_holds_only_the_distributions_named(tmp_path):
    import subprocess

    slim = _tool("slim_venv")
    built = slim.build(tmp_path / "venv", ["iniconfig"])
    assert built["distributions"] == [f"iniconfig {importlib.metadata.version('iniconfig')}"]
    python = tmp_path / "venv" / "bin" / "python"
    where = subprocess.run([python, "-c", "import iniconfig; print(iniconfig.__file__)"],
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(tmp_path / "venv")), where
    numpy = subprocess.run([python, "-c", "import numpy"], capture_output=True, text=True)
    assert "No module named 'numpy'" in numpy.stderr


def test_slim_venv_names_cuda_libraries_loaded_from_elsewhere():
    slim = _tool("slim_venv")
    maps = "\n".join(f"7f00-7f01 r-xp 00000000 08:01 12 {path}" for path in [
        "/venv/lib/site-packages/nvidia/cu13/lib/libnvrtc.so.13",
        "/usr/lib/x86_64-linux-gnu/libcuda.so.580.1",         # the driver: expected outside
        "/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.580.1",
        "/usr/local/cuda/lib64/libcublas.so.13",
        "/usr/lib/libc.so.6"]) + "\n7f02-7f03 rw-p 00000000 00:00 0 \n"
    assert slim.foreign_cuda_libraries(maps, "/venv") == ["/usr/local/cuda/lib64/libcublas.so.13"]

"""`triattn-run`: a model's own command run with its blocks routed, on the CPU.

The command is `runner_target` (Boltz's own PairformerModule built inside the command) as a
console script (a temporary dist-info), a module (-m) and a script, and the models' own
console scripts where they import (`--help`: predicting needs downloads, weights and the
CCD). Without a GPU every call falls back; `cpu_routed` lets CPU tensors reach
the op (the NumPy backend) to count calls through the kernels."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import triattn_cupy.torch as tt  # noqa: E402
from triattn_cupy.torch import blocks, run  # noqa: E402

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
REPORT = "triattn-run: {} triangle attention blocks accelerated, {} calls through the kernels"


@pytest.fixture
def cpu_routed(monkeypatch):
    monkeypatch.setattr(blocks, "_ACCELERATED_DEVICES", {"cuda", "cpu"})


@pytest.fixture
def console_script(tmp_path, monkeypatch):
    """`fake-predict`: runner_target.main as an installed console script (skips where
    boltz-community, whose model it builds, is not installed)."""
    pytest.importorskip("boltz.model.layers.pairformer",
                        reason="boltz-community is not installed (pip install --no-deps "
                               "boltz-community==2.12.0 einops scipy)")
    dist = tmp_path / "fake_model-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-model\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[console_scripts]\nfake-predict = runner_target:main\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fake-predict"


def targets(console_script):
    return {"console script": [console_script], "module": ["-m", "runner_target"],
            "script": [str(TESTS / "runner_target.py")]}


@pytest.mark.parametrize("how", ["console script", "module", "script"])
def test_runs_the_command_with_its_blocks_routed(how, console_script, cpu_routed, capsys):
    argv_before, path_before = sys.argv[:], sys.path[:]
    code = run.main(["--precision", "bf16", *targets(console_script)[how], "--layers", "3"])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("pair sum ")
    assert err.strip().splitlines()[-1] == REPORT.format(6, 6) + ", 0 fell back"
    assert sys.argv == argv_before and sys.path == path_before and not tt.enabled()


def test_fallbacks_warn_and_are_reported(console_script, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = run.main([console_script, "--grad", "--exit", "3"])
    assert code == 3  # the command's own exit status
    messages = [str(w.message) for w in caught if issubclass(w.category, tt.FallbackWarning)]
    assert len(messages) == 4
    assert messages[0].startswith("PairformerModule.layers.0.tri_att_start: the original "
                                  "forward runs, not the kernels: gradients are enabled")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == REPORT.format(4, 0) + ", 4 fell back (4: gradients enabled)"


def test_strict_fails_naming_the_block(console_script, capsys):
    assert run.main(["--strict", console_script]) == 1
    err = capsys.readouterr().err
    assert "triattn-run: error: PairformerModule.layers.0.tri_att_start: the kernels do not " \
           "compute this call (strict): the pair is on cpu" in err
    assert err.strip().splitlines()[-1] == ("triattn-run: 1 triangle attention block "
                                            "accelerated, 0 calls through the kernels, 1 fell "
                                            "back (1: tensors on cpu)")


@pytest.mark.parametrize("argv, ours, command", [
    (["boltz", "predict", "in.yaml", "--out_dir", "o"], [],
     ["boltz", "predict", "in.yaml", "--out_dir", "o"]),
    (["--precision", "tf32", "--strict", "boltz", "--precision", "x"],
     ["--precision", "tf32", "--strict"], ["boltz", "--precision", "x"]),
    (["--strict", "-m", "mod", "--layers", "1"], ["--strict", "-m", "mod"], ["--layers", "1"]),
    (["-mmod", "-m", "x"], ["-mmod"], ["-m", "x"]),
    (["--precision=bf16", "--", "--odd-name"], ["--precision=bf16"], ["--odd-name"]),
])
def test_options_before_the_command_are_ours(argv, ours, command):
    assert run._split(argv) == (ours, command)


@pytest.mark.parametrize("argv, message", [
    ([], "give the command to run"),
    (["no-such-command-here"], "no console script named 'no-such-command-here'"),
    (["missing/script.py"], "script 'missing/script.py' is not a file"),
    (["--precision", "fp16", "boltz"], "invalid choice: 'fp16'"),
    (["--bogus", "boltz"], "unrecognized arguments: --bogus"),
])
def test_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        run.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not tt.enabled()


@pytest.mark.parametrize("command", [["boltz", "predict", "--help"], ["protenix", "--help"],
                                     ["run_openfold", "--help"]])
def test_the_models_own_console_scripts(command, capsys):
    """Offline, their help (predicting needs weights and the CCD downloaded)."""
    entry = run._console_script(command[0])
    if entry is None:
        pytest.skip(f"{command[0]}: its model's package is not installed")
    try:
        entry.load()
    except ImportError as error:
        pytest.skip(f"{command[0]} does not import here: {error}")
    assert run.main(command) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        REPORT.format(0, 0) + ", 0 fell back"


def test_the_installed_entry_point_runs_in_a_fresh_process(console_script):
    """As the console script's launcher runs it: a module of its own, then sys.exit."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from triattn_cupy.torch.run import main; "
                               "sys.exit(main())", "-m", "runner_target", "--exit", "5"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 5, result.stderr
    assert result.stdout.startswith("pair sum ")
    assert "FallbackWarning: PairformerModule.layers.1.tri_att_end" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == \
        REPORT.format(4, 0) + ", 4 fell back (4: tensors on cpu)"

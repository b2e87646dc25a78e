"""benchmarks/boltz_blocks.py as a dry run on the CPU: the script runs end to end, writes its
JSON and table, and its error measure reads ~1e-7 for the model's own fp32 forward."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("boltz.model.layers.triangular_attention.attention",
                    reason="boltz-community is not installed")

from benchmarks import boltz_blocks  # noqa: E402


def test_dry_run_writes_json_and_table(tmp_path):
    boltz_blocks.main(["--device", "cpu", "--sizes", "12", "--modes",
                       "eager_fp32,cueq_fp32,ours_fp32", "--out", str(tmp_path),
                       "--budget", "60", "--max-reps", "3"])
    results = json.loads((tmp_path / "boltz_blocks.json").read_text())
    assert set(results["runs"]) == {"12"}
    for runs in results["runs"].values():
        for mode in ("eager_fp32", "ours_fp32"):  # ours falls back on the CPU
            assert runs[mode]["rel_l2"] < 1e-5 and len(runs[mode]["block_ms"]) == 4
        assert "ms" in runs["cueq_fp32"] or runs["cueq_fp32"]["status"].startswith("absent")
    table = (tmp_path / "boltz_blocks.md").read_text()
    assert "| 12 | ours_fp32 | fp32 |" in table

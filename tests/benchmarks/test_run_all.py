"""``benchmarks/run_all.py``: where a run goes, and what publishing keeps."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_all():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_run(run_dir: Path) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "machine.json").write_text(json.dumps({"date": "2030-01-02", "cpu": "x", "cores": 2, "torch": "t"}))
    for mode in ("ifb-blocking", "ifb-inflight", "ifb-static"):
        (run_dir / f"{mode}.server.log").write_text("log\n")
        for workload in ("fixed", "skewed"):
            (run_dir / f"{mode}__{workload}.json").write_text("{}")
            (run_dir / f"{mode}__{workload}.png").write_bytes(b"png")
    (run_dir / "ifb-inflight-reuse__shared_prefix.png").write_bytes(b"png")


def test_raw_runs_are_ignored_by_git(run_all):
    assert run_all.RUNS_DIR == ROOT / "benchmarks" / "runs"
    assert "/benchmarks/runs/" in (ROOT / ".gitignore").read_text().splitlines()


def test_publish_replaces_the_published_run_and_keeps_one_plot_per_workload(run_all, tmp_path):
    results = tmp_path / "results"
    (results / "2030-01-01").mkdir(parents=True)
    (results / "2030-01-01" / "old.json").write_text("{}")
    _fake_run(tmp_path / "runs" / "2030-01-02")

    published = run_all.publish(tmp_path / "runs" / "2030-01-02", results)

    assert [p.name for p in results.iterdir()] == ["2030-01-02"]
    names = sorted(p.name for p in published.iterdir())
    assert [n for n in names if n.endswith(".png")] == [
        "ifb-inflight-reuse__shared_prefix.png", "ifb-inflight__fixed.png", "ifb-inflight__skewed.png"]
    assert len([n for n in names if n.endswith(".json")]) == 7 and "machine.json" in names
    assert len([n for n in names if n.endswith(".log")]) == 3


def test_publish_refuses_a_run_inside_the_published_folder(run_all, tmp_path):
    _fake_run(tmp_path / "results" / "2030-01-02")
    with pytest.raises(ValueError, match="inside"):
        run_all.publish(tmp_path / "results" / "2030-01-02", tmp_path / "results")


def test_published_results_stay_small():
    files = [p for p in (ROOT / "benchmarks" / "results").rglob("*") if p.is_file()]
    assert len({p.parent for p in files}) == 1, "benchmarks/results/ keeps only the run the README cites"
    assert sum(p.stat().st_size for p in files) < 2 * 1024 * 1024
    run = files[0].parent.name
    assert f"results/{run}/" in (ROOT / "benchmarks" / "README.md").read_text()

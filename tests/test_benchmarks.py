"""benchmarks/run_all.py runs every invocation that writes a results file."""

import sys
from pathlib import Path

import pytest

BENCHMARKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS_DIR))

import run_all  # noqa: E402


def test_every_results_file_has_an_invocation():
    recorded = {path.stem for path in (BENCHMARKS_DIR / "results").glob("*.md")}
    assert recorded <= set(run_all.invocations())


def test_invocations_name_real_scripts_and_flags():
    runs = run_all.invocations()
    assert runs["kl_approx"] == ["bench_kl.py", "--approx"]
    assert runs["loop_multi_turn"] == ["bench_loop.py", "--multi-turn"]
    assert runs["losses"] == ["bench_losses.py", "--kernels"]
    for script, *args in runs.values():
        source = (BENCHMARKS_DIR / script).read_text()
        assert '"--quick"' in source, script
        for arg in args:
            assert f'"{arg}"' in source, (script, arg)


def test_only_selects_and_rejects_unknown_names():
    assert list(run_all.invocations(["losses", "kl"])) == ["kl", "losses"]
    with pytest.raises(SystemExit, match="--only nope: unknown"):
        run_all.invocations(["nope", "kl"])

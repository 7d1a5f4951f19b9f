"""benchmarks/run_all.py runs every invocation that writes a results file; benchmarks/RESULTS.md
is what benchmarks/collect_results.py generates from the results files."""

import re
import shutil
import sys
from pathlib import Path

import pytest

BENCHMARKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS_DIR))

import collect_results  # noqa: E402
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


# --- RESULTS.md: generated whole by collect_results.py ---------------------------------------

RESULTS_MD = BENCHMARKS_DIR / "RESULTS.md"


def _figure_rows(text: str) -> list[list[str]]:
    table = text[text.index("## Figures"):]
    table = table[table.index("| benchmark |"):]
    table = table[:table.index("\n\n")]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]


def test_results_md_is_what_collect_results_generates():
    # a hand edit, or results files changed without regenerating the page, fails here:
    # run `python benchmarks/collect_results.py`
    assert RESULTS_MD.read_text() == collect_results.build(BENCHMARKS_DIR / "results")


def test_every_figure_row_parses_and_links_its_results_file():
    rows = _figure_rows(RESULTS_MD.read_text())
    assert len(rows) == len(collect_results.FIGURES)
    names = set()
    for (bench, figure, value, against, target, machine, details), spec in zip(rows, collect_results.FIGURES):
        assert bench == spec.bench and figure == spec.figure
        assert re.match(r"[-+]?\d+(\.\d+)?(x|%| MiB| s)?( |$)", value), value
        assert against and machine and against != "-" and machine != "-"
        assert target == "-" or re.fullmatch(r"[<>]=? [-+]?[\d.]+(x|%)?: (met|\*\*missed\*\*)", target), target
        link = re.fullmatch(r"\[(\w+)\.md\]\(results/(\w+)\.md(#[\w-]+)?\)", details)
        assert link and link.group(1) == link.group(2) == bench, details
        assert (BENCHMARKS_DIR / "results" / f"{bench}.md").exists()
        names.add((figure, against))
    assert len(names) == len(rows)  # no figure twice


def test_every_results_file_has_a_headline_figure_and_existing_notes_links():
    text = RESULTS_MD.read_text()
    recorded = {path.stem for path in (BENCHMARKS_DIR / "results").glob("*.md")}
    assert recorded == {f.bench for f in collect_results.FIGURES}
    for target in re.findall(r"\]\(((?:results|notes)/[\w.]+\.md)", text):
        assert (BENCHMARKS_DIR / target).exists(), target


def test_results_md_has_one_figures_table_short_cells_and_lines():
    text = RESULTS_MD.read_text()
    assert text.count("| benchmark | figure |") == 1
    summary = text[text.index("## Summary\n\n") + len("## Summary\n\n"):text.index("\n\n## Figures")]
    assert "\n\n" not in summary  # one paragraph
    for line in text.splitlines():
        assert len(line) <= collect_results.MAX_LINE, line[:80]
        if line.startswith("|"):
            for cell in line.strip().strip("|").split("|"):
                assert len(cell.strip()) <= collect_results.MAX_CELL, cell[:80]


def test_a_missing_headline_figure_is_an_error_naming_the_file_and_the_figure(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(BENCHMARKS_DIR / "results", results)
    losses = results / "losses.md"
    text = losses.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| ppo_loss | trl-style | eager |"))
    losses.write_text(text.replace(row + "\n", ""))
    with pytest.raises(collect_results.FigureNotFound) as error:
        collect_results.build(results)
    message = str(error.value)
    assert "losses.md" in message
    assert "`ppo_loss` fwd+bwd, eager, all metrics, [256, 4096] against TRL-style loss" in message


def test_a_renamed_column_or_a_missing_results_file_is_an_error(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(BENCHMARKS_DIR / "results", results)
    packing = results / "packing.md"
    packing.write_text(packing.read_text().replace("| tokens / s |", "| tok/s |"))
    collect_results.build(results)  # a column no figure reads: fine
    packing.write_text(packing.read_text().replace("| x padded |", "| ratio |", 1))
    with pytest.raises(collect_results.FigureNotFound, match=r"packing\.md: headline figure 'packed GRPO step"):
        collect_results.build(results)
    packing.unlink()
    with pytest.raises(collect_results.FigureNotFound, match=r"no results file for packing\.md"):
        collect_results.build(results)


def test_collect_results_main_exits_with_the_error(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results"
    shutil.copytree(BENCHMARKS_DIR / "results", results)
    (results / "kl.md").write_text("## exact_kl\n\nno table\n")
    out = tmp_path / "RESULTS.md"
    monkeypatch.setattr(sys, "argv", ["collect_results.py", "--results", str(results), "--out", str(out)])
    with pytest.raises(SystemExit, match=r"error: .*kl\.md: headline figure '`exact_kl`"):
        collect_results.main()
    assert not out.exists()

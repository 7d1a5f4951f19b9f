"""plot_run: one panel per PANELS entry, drawn from metrics.jsonl, NaN steps left out."""

import json

from matplotlib.figure import Figure
import pytest

from torchforge.trainer.plot import PANELS, plot_run


def test_each_panel_draws_its_logged_steps_and_says_when_nothing_was_logged(tmp_path, monkeypatch):
    rows = [{"step": 1, "reward": 0.1, "kl": 0.0}, {"step": 2, "reward": None, "kl": 0.2}, {"step": 3, "reward": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig",
                        lambda fig, *a, **kw: (drawn.append(fig), save(fig, *a, **kw))[1])
    out = plot_run(tmp_path)
    assert out == tmp_path / "curves.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = drawn
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert set(axes) == {title for _, title in PANELS}
    reward, kl = axes["reward (mean)"], axes["KL(pi || ref)"]
    assert [list(line.get_xdata()) for line in reward.lines] == [[1, 3]]  # the null (NaN) step is left out
    assert [list(line.get_ydata()) for line in reward.lines] == [[0.1, 0.3]]
    assert [list(line.get_xdata()) for line in kl.lines] == [[1, 2]]
    for key, title in PANELS:
        if key not in ("reward", "kl"):
            assert not axes[title].lines and [t.get_text() for t in axes[title].texts] == ["not logged"], title


def test_the_png_goes_where_asked(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 1.0}) + "\n")
    out = plot_run(tmp_path, tmp_path / "elsewhere.png")
    assert out == tmp_path / "elsewhere.png" and out.stat().st_size > 0
    assert not (tmp_path / "curves.png").exists()


def test_a_folder_without_metrics_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl does not exist"):
        plot_run(tmp_path)

"""The README's code runs: every ```python block except those that load a model from a path."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
# needs a real model folder and a user's dataset: shown for reading, run in tests/trainer/test_trainer.py
# against the tiny local model (test_card_quick_start_runs_as_written)
RUNNABLE = [b for b in BLOCKS if "path/to/local/model" not in b]


def test_the_readme_has_runnable_examples():
    assert len(RUNNABLE) >= 3 and len(BLOCKS) > len(RUNNABLE)


@pytest.mark.parametrize("code", RUNNABLE, ids=lambda b: b.strip().splitlines()[-1][:40])
def test_readme_block_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})


def test_readme_names_every_public_function():
    import torchforge

    text = README.read_text()
    missing = [n for n in torchforge.__all__ if n.islower() and f"`{n}" not in text and f"{n}`" not in text
               and f", `{n}`" not in text]
    assert not missing, missing

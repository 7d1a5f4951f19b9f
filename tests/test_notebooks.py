"""Every notebook under notebooks/ runs top to bottom, and is committed without outputs.

Each notebook is executed with nbclient in a fresh kernel whose working directory is a
temporary folder. The kernel is the "python3" kernel, which jupyter_client starts with the
interpreter running the tests (ipykernel is a dev dependency).
"""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_without_outputs(path):
    nbformat = pytest.importorskip("nbformat", reason="reading notebooks needs nbformat (pip install -e '.[dev]')")
    notebook = nbformat.read(path, as_version=4)
    dirty = [
        i for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, (
        f"{path.name}: code cells {dirty} have outputs or an execution count; "
        "clear them before committing (Jupyter: Edit > Clear Outputs of All Cells)"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="running notebooks needs nbformat (pip install -e '.[dev]')")
    nbclient = pytest.importorskip("nbclient", reason="running notebooks needs nbclient (pip install -e '.[dev]')")
    pytest.importorskip("ipykernel", reason="running notebooks needs ipykernel (pip install -e '.[dev]')")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on failure

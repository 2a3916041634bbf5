"""notebooks/compare.ipynb runs headless against the committed results, and bad input is named.

Each test executes the real notebook in a fresh ``python3`` kernel (nbclient), from
``notebooks/`` as Jupyter would; a bad-input test first swaps the ``RESULTS = [...]`` line of the
first code cell for a path under ``tmp_path``.
"""

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "compare.ipynb"
CPU_RESULTS = ROOT / "experiments" / "results" / "cpu" / "sweep.jsonl"
PER_LAYER = ROOT / "experiments" / "results" / "analyze" / "per_layer.jsonl"


def _execute(nb):
    """Run every cell of ``nb`` in place (120 s per cell); raises CellExecutionError."""
    client = NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()
    return nb


def _with_results(*paths):
    """The notebook with its first code cell reading ``paths`` instead of the committed run."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    lines = cell.source.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith("RESULTS = [")]
    assert len(at) == 1, "the first code cell should have one `RESULTS = [...]` line"
    lines[at[0]] = f"RESULTS = {[str(p) for p in paths]!r}"
    cell.source = "\n".join(lines)
    return nb


def _outputs(nb, kinds=("stream", "display_data", "execute_result", "error")):
    return [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type in kinds
    ]


def test_committed_clean():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "clear the outputs"
    # Every figure or table is introduced by a markdown cell saying how to read it.
    for before, cell in zip(nb.cells, nb.cells[1:], strict=False):
        if cell.cell_type == "code" and cell is not code[0]:
            assert before.cell_type == "markdown", cell.source[:80]


def test_runs_on_committed_results():
    assert CPU_RESULTS.is_file(), f"{CPU_RESULTS} is missing: run experiments/sweep.py"
    nb = _execute(nbformat.read(NOTEBOOK, as_version=4))
    assert not _outputs(nb, ("error",))
    pngs = [o for o in _outputs(nb, ("display_data",)) if "image/png" in o.data]
    assert len(pngs) >= 4  # Pareto, memory breakdown, slowdown, per-layer


def test_runs_on_two_files_with_measured_peaks(tmp_path):
    # A stand-in GPU run: the committed rows with a measured peak 10% above the prediction.
    gpu = tmp_path / "gpu.jsonl"
    with open(CPU_RESULTS) as src, open(gpu, "w") as dst:
        for line in src:
            row = json.loads(line)
            if row.get("status") == "ok":
                row.update(backend="gpu", measured_peak_bytes=int(row["peak_bytes"] * 1.1))
                row["peak_error"] = row["peak_bytes"] / row["measured_peak_bytes"] - 1
            dst.write(json.dumps(row) + "\n")
    nb = _execute(_with_results(CPU_RESULTS, gpu))
    text = "\n".join(str(o.get("data", {}).get("text/plain", "")) for o in _outputs(nb))
    assert "gpu.jsonl]" in text  # panels and tables keep the two runs apart
    assert "No measured peak" not in "\n".join(
        str(o.get("data", {}).get("text/markdown", "")) for o in _outputs(nb)
    )


@pytest.mark.parametrize(
    "name, content, problem",
    [
        ("missing.jsonl", None, "no such file"),
        ("empty.jsonl", "", "no rows"),
        ("bad.jsonl", '{"format": 1}\nnot json\n', "line 2 is not JSON"),
        ("per_layer.jsonl", PER_LAYER, "lacks format"),  # a results file of another kind
    ],
    ids=["missing", "empty", "bad-json", "wrong-kind"],
)
def test_bad_input_named_in_first_cell(tmp_path, name, content, problem):
    path = tmp_path / name
    if isinstance(content, Path):
        path.write_bytes(content.read_bytes())
    elif content is not None:
        path.write_text(content)
    nb = _with_results(path)
    with pytest.raises(CellExecutionError):
        _execute(nb)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert first.outputs, "the first code cell printed nothing"
    message = first.outputs[0]
    assert message.output_type == "stream", message
    assert str(path) in message.text and problem in message.text, message.text
    assert first.outputs[-1].output_type == "error"
    assert not any(c.outputs for c in nb.cells[nb.cells.index(first) + 1 :] if "outputs" in c)

"""Benchmark results users can read: the README's headline table, docs tables and plots, from the JSON.

``vpipe bench --json DIR`` leaves ``DIR/NAME.json`` per benchmark. This package turns them
into markdown, and writes it between markers in existing files, so no number in the
README or ``docs/benchmarks.md`` is typed in by hand:

- ``<!-- headline:start -->`` ... ``<!-- headline:end -->``: one row per headline result;
- ``<!-- results:start -->`` ... ``<!-- results:end -->``: every benchmark's full table;
- ``<!-- gpu:start -->`` ... ``<!-- gpu:end -->``: the GPU suite's results (``docs/results/gpu``).

``--plots DIR`` also draws PNGs (needs matplotlib, the ``plot`` extra). Benchmarks whose
JSON is missing are left out and said so.

    python -m vpipe_lab.report docs/results --readme README.md --docs docs/benchmarks.md --plots docs/img

The parts, one job each: ``results.py`` (reading the JSON), ``markdown.py`` (the table and number formats
the others share), ``headline.py`` (the README's headline rows), ``tables.py`` (every benchmark's full
table), ``gpu.py`` (the GPU section), ``plots.py`` (the PNGs) and ``command.py`` (``python -m
vpipe_lab.report``: rewriting the files between their markers).
"""

from vpipe_lab.report.command import main, replace_between
from vpipe_lab.report.gpu import gpu_markdown
from vpipe_lab.report.headline import headline_markdown, headline_rows
from vpipe_lab.report.plots import plot
from vpipe_lab.report.results import Results, load_results
from vpipe_lab.report.tables import SECTIONS, results_markdown

__all__ = ["load_results", "headline_rows", "headline_markdown", "results_markdown", "gpu_markdown",
           "replace_between",
           "plot", "main", "Results", "SECTIONS"]

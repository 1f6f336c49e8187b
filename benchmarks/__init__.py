"""The benchmarks: one script a measurement, each printing its tables and, with --out (--json_out,
--json in a few), writing its results as JSON; the figures and how to read them are on the pages
under docs/benchmarks/ (the simulator's sweeps on docs/scheduler.md and docs/serving.md).

Run one from the repository root of a `make setup` checkout (an editable install) as a module:
`.venv/bin/python -m benchmarks.NAME [flags]` (`--help` lists the flags of a script that takes any). The scripts share `benchmarks/common.py`: fair timing of two sides (`interleave`:
best of N in turns; `Machine`: the cores used, and the load and other processes' CPU around a run), the
measuring functions that benchmarks/device_check.py times with too, table and ratio printing
(`print_markdown_table`, `markdown_header`, `geomean`), `write_json` for the results file, and `DATA`:
the recorded workloads some scripts replay (benchmarks/data/)."""

"""The documentation site builds with `mkdocs build --strict` (what `make docs` runs): every page in
nav, every relative link and anchor resolving, the API reference's objects found."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_docs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "engine" / "index.html").read_text().count("EngineConfig") > 1

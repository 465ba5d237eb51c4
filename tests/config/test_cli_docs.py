"""docs/cli-reference.md is generated from the flag declarations and must be up to date."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from miles.config.arguments import all_flags, flag_groups
from miles.config.cli_docs import flag_cell, render_markdown

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "cli-reference.md"
REGENERATE = "python -m miles.config.cli_docs > docs/cli-reference.md"


def test_committed_docs_are_current():
    assert DOCS.exists(), f"{DOCS} is missing; run `{REGENERATE}`"
    assert DOCS.read_text(encoding="utf-8") == render_markdown(), f"{DOCS} is stale; run `{REGENERATE}`"


def test_docs_have_one_row_per_flag_under_its_group():
    text = render_markdown()
    for title, flags in flag_groups():
        section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
        for flag in flags:
            assert f"| {flag_cell(flag)} |" in section, f"{flag.name} is missing from section {title!r}"
    assert text.count("\n| `--") == len(all_flags())


def test_docs_mark_extensions_and_show_derived_defaults():
    text = render_markdown()
    dry_run_row = next(line for line in text.splitlines() if line.startswith("| `--dry-run`"))
    assert "*Extension.*" in dry_run_row
    gbs_row = next(line for line in text.splitlines() if line.startswith("| `--global-batch-size`"))
    assert "| derived |" in gbs_row
    buffer_row = next(line for line in text.splitlines() if line.startswith("| `--update-weight-buffer-size`"))
    assert "| 512 MiB |" in buffer_row


def test_module_entry_point_prints_the_docs():
    result = subprocess.run([sys.executable, "-m", "miles.config.cli_docs"], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == render_markdown()

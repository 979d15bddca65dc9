"""The generated pages of the docs' reference section (docs/reference/cli.md,
configuration.md, exit-codes.md) are what docs/_hooks/reference_pages.py writes
from the code today: a flag, a field or an exit code changed without the page
fails here. (The API page is rendered from the docstrings at build time:
tests/unit/test_api.py checks its entries.)"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re

import pytest

from tests._util import REPO

_spec = importlib.util.spec_from_file_location(
    "reference_pages", REPO / "docs" / "_hooks" / "reference_pages.py")
pages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pages)


@pytest.mark.parametrize("name", sorted(pages.PAGES))
def test_the_generated_page_is_up_to_date(name):
    committed = (pages.REFERENCE / name).read_text()
    assert committed == pages.PAGES[name](), (
        f"docs/reference/{name} is stale: run python {pages.SCRIPT}")


def test_the_staleness_check_finds_a_changed_page(tmp_path, monkeypatch):
    for name, make in pages.PAGES.items():
        (tmp_path / name).write_text(make())
    monkeypatch.setattr(pages, "REFERENCE", tmp_path)
    assert pages.stale_pages() == []
    page = tmp_path / "exit-codes.md"
    page.write_text(page.read_text().replace("| 75 |", "| 74 |"))
    assert pages.stale_pages() == ["exit-codes.md"]
    assert pages.main(["--check"]) == 1


def _table_rows(page: str) -> list[list[str]]:
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            for line in page.splitlines() if line.startswith("| ") and "---" not in line]


def test_the_cli_page_has_every_subcommand_and_flag():
    """Every subcommand has its section and every option its row, read from the
    parser (not from the page generator's own walk)."""
    from tfmulti import cli

    page = (pages.REFERENCE / "cli.md").read_text()
    subcommands = cli._subcommands(cli.build_parser())
    sections = re.split(r"^## `tfmulti ([\w-]+)`$", page, flags=re.M)
    bodies = dict(zip(sections[1::2], sections[2::2]))
    assert list(bodies) == list(subcommands)
    for name, parser in subcommands.items():
        flags = {m.group(1) for row in _table_rows(bodies[name])
                 if (m := re.match(r"`(--\w[\w-]*)[` ]", row[0]))}
        options = {a.option_strings[0] for a in parser._actions
                   if a.option_strings and not isinstance(a, argparse._HelpAction)}
        assert flags == options, name


def test_the_cli_page_shows_the_defaults():
    page = (pages.REFERENCE / "cli.md").read_text()
    launch = page.split("## `tfmulti launch`")[1].split("\n## ")[0]
    rows = {row[0].split("`")[1]: row[1] for row in _table_rows(launch)[1:]}
    assert rows["--num_workers"] == "`2`"
    assert rows["--isolate"] == "`on`"
    estimate = page.split("## `tfmulti estimate-memory`")[1].split("\n## ")[0]
    rows = {row[0].split("`")[1]: row[1] for row in _table_rows(estimate)[1:]}
    assert rows["--distribution"] == "`one_device`"  # the subcommand's own default
    assert rows["--global_batch_size"] == "`256`"  # TrainConfig's, absent from the namespace


def test_the_configuration_page_has_every_field_with_its_default():
    from tfmulti.config.train_config import TrainConfig

    rows = _table_rows((pages.REFERENCE / "configuration.md").read_text())[1:]
    fields = dataclasses.fields(TrainConfig)
    assert [row[0] for row in rows] == [f"`{f.name}`" for f in fields]
    for row, field in zip(rows, fields):
        default = ",".join(field.default) if isinstance(field.default, tuple) and \
            field.default else field.default
        shown = repr(default) if isinstance(default, str) else str(default)
        assert row[2] == f"`{shown}`", field.name
        assert row[3], field.name


def test_the_exit_codes_page_has_every_code_of_the_module():
    from tfmulti.cluster import exit_codes

    rows = _table_rows((pages.REFERENCE / "exit-codes.md").read_text())[1:]
    listed = {row[1].strip("`"): int(row[0]) for row in rows}
    module = {name: getattr(exit_codes, name) for name in exit_codes.__all__
              if isinstance(getattr(exit_codes, name), int)}
    assert listed == module
    for row in rows:
        assert row[2], row


def test_the_reference_index_names_every_page_and_subcommand():
    from tfmulti import cli

    index = (pages.REFERENCE / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    assert linked == {"api.md", *pages.PAGES}
    cli_item = next(line for line in index.split("\n- ") if line.startswith("[CLI]"))
    for name in cli._subcommands(cli.build_parser()):
        assert f"`{name}`" in cli_item, name

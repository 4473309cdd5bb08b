"""``telemetry/SCHEMA.md`` documents exactly the tables and columns of ``_schema.TABLES`` (names,
SQL types, in order) and the views; every view compiles on an empty store."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from meshplan.telemetry._schema import TABLES, VIEWS
from meshplan.telemetry._store import _sql_type, Store

DOC = Path(__file__).resolve().parents[2] / "telemetry" / "SCHEMA.md"
_HEADING = re.compile(r"^### `(\w+)`\s*$")
_ROW = re.compile(r"^\|\s*`(\w+)`\s*\|\s*(\w+)\s*\|")


def documented_tables() -> dict[str, list[tuple[str, str]]]:
    """``## Tables`` of SCHEMA.md: table -> [(column, SQL type)] in the order documented."""
    text = DOC.read_text()
    section = text.split("\n## Tables\n", 1)[1].split("\n## ", 1)[0]
    tables: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in section.splitlines():
        if m := _HEADING.match(line):
            current = m.group(1)
            assert current not in tables, f"SCHEMA.md documents table {current} twice"
            tables[current] = []
        elif (m := _ROW.match(line)) and current:
            tables[current].append((m.group(1), m.group(2)))
    return tables


def test_schema_md_documents_every_table_and_column() -> None:
    doc = documented_tables()
    assert list(doc) == list(TABLES), "SCHEMA.md's tables differ from _schema.TABLES"
    for table, schema in TABLES.items():
        expected = [(f.name, _sql_type(f.type)) for f in schema]
        assert doc[table] == expected, f"SCHEMA.md's `{table}` columns differ from TABLES"


def test_schema_md_documents_the_views() -> None:
    views = DOC.read_text().split("\n## Views\n", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"^- `(\w+)`", views, re.M)) == set(VIEWS)


@pytest.mark.parametrize("view", sorted(VIEWS))
def test_views_compile_on_an_empty_store(tmp_path: Path, view: str) -> None:
    with Store.open(tmp_path / "t.duckdb") as s:
        assert s.sql(f"SELECT * FROM {view}").num_rows == 0

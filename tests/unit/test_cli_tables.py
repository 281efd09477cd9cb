"""The CLI's table declarations agree with themselves (qinglong_cli.output)."""

from __future__ import annotations

from qinglong_cli.output import STREAMED_WIDTHS, TABLES


def test_every_streamed_table_gives_a_width_to_each_column_but_its_last() -> None:
    for type_name, widths in STREAMED_WIDTHS.items():
        columns = TABLES[type_name]
        assert len(widths) == len(columns) - 1, type_name
        headers = [header for header, _ in columns]
        assert all(width >= len(header) for width, header in zip(widths, headers, strict=False))

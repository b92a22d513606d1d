"""The README's table of job fields, generated from the job schema (``JobSpec`` in
``pan2render/jobs/spec.py``).

    python scripts/field_table.py            # print the table
    python scripts/field_table.py --write    # replace the table in README.md

tests/jobs/test_schema.py fails while README.md's table differs from what this writes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pan2render.jobs.spec import field_table

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- job-fields -->\n", "<!-- /job-fields -->"


def with_table(text: str) -> str:
    """``text`` (the README) with the part between the job-fields markers replaced by the table."""
    head, sep, rest = text.partition(START)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise SystemExit(f"{README}: no {START.strip()} ... {END} block to fill")
    return head + START + field_table() + END + tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite the table in README.md")
    args = p.parse_args(argv)
    if not args.write:
        sys.stdout.write(field_table())
        return 0
    README.write_text(with_table(README.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote the job-field table into {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

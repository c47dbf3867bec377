"""Re-record `tests/durations.json` (the seconds of each test file, which `tests/conftest.py` hands out longest
first) from a whole run's JUnit XML, and print the ten slowest tests:

    make test && .venv/bin/python bench/test_durations.py    (`make test` writes build/test-results.xml)

A file's seconds are the sum of its tests' (set-up included, as pytest reports them); files under 5 s are left
out (they count 0: their order does not matter)."""

from __future__ import annotations

import argparse
import collections
import json
import xml.etree.ElementTree as ET
from pathlib import Path

DURATIONS = Path(__file__).resolve().parent.parent / "tests" / "durations.json"


def file_seconds(junit: Path) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """Seconds by test file name, and every test's (seconds, id), from a JUnit XML report."""
    by_file: collections.Counter[str] = collections.Counter()
    tests = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        module, seconds = case.get("classname", ""), float(case.get("time", 0))
        by_file[module.split(".")[-1] + ".py"] += seconds
        tests.append((seconds, f"{module}::{case.get('name')}"))
    return dict(by_file), sorted(tests, reverse=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", type=Path, nargs="?", default=DURATIONS.parent.parent / "build" / "test-results.xml",
                   help="the JUnit XML of a whole `make test` run (default: the last one's)")
    a = p.parse_args()
    by_file, tests = file_seconds(a.junit)
    kept = {name: round(s) for name, s in sorted(by_file.items(), key=lambda kv: -kv[1]) if s >= 5}
    DURATIONS.write_text(json.dumps(kept, indent=1) + "\n")
    print(f"{DURATIONS}: {len(kept)} files, {sum(by_file.values()):.0f} test-seconds in all")
    for seconds, test in tests[:10]:
        print(f"{seconds:8.1f}  {test}")


if __name__ == "__main__":
    main()

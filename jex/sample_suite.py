"""A deterministic sample suite with real, checkable gold answers.

Nine catalogs over three legs, 2 to 5 options each. Every gold answer is computed, not typed in:
arithmetic, comparisons, boolean expressions, weekday arithmetic, alphabetical order, unit
conversion, capitals from a small fact table, letter counts, and one catalog (`sorted_max`) whose
construction lists the options in ascending order most of the time, so the gold answer sits at the
last label: the kind of catalog a positional overlay corrects.

Each question yields one or two rows (the second with its options reordered); both share a
`question_id`, which is the bootstrap cluster. The same seed and row count give the same bytes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from jex.fileio import atomic_open, write_toml

LABELS = "ABCDE"
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Brazil": "Brasilia", "Argentina": "Buenos Aires",
    "Peru": "Lima", "Chile": "Santiago", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Poland": "Warsaw", "Greece": "Athens", "Turkey": "Ankara", "Russia": "Moscow", "Ireland": "Dublin",
    "Austria": "Vienna", "Hungary": "Budapest", "Thailand": "Bangkok", "Vietnam": "Hanoi",
    "Australia": "Canberra", "Cuba": "Havana", "Denmark": "Copenhagen", "Belgium": "Brussels",
    "Netherlands": "Amsterdam", "Switzerland": "Bern", "Morocco": "Rabat", "Nigeria": "Abuja",
}
WORDS = ("apple banana cherry delta eagle falcon garden harbor island jungle kettle lemon mango "
         "nectar orange pepper quartz river salmon tiger umbrella velvet walnut yellow zebra anchor "
         "basket candle dragon ember forest glacier hollow ivory jasper kernel lantern marble needle "
         "oyster pebble quiver ribbon saddle thistle violet willow").split()
UNITS = [("metres", "centimetres", 100), ("kilograms", "grams", 1000), ("hours", "minutes", 60),
         ("kilometres", "metres", 1000), ("minutes", "seconds", 60), ("litres", "millilitres", 1000)]

# id, name, leg, area, number of options
CATALOGS = [
    ("arith", "Two-number arithmetic", "public", "math", 4),
    ("capitals", "Capital cities", "public", "knowledge", 4),
    ("sorted_max", "Largest number (ascending construction)", "public", "math", 4),
    ("boolean", "Boolean expressions", "eqS", "logic", 2),
    ("weekdays", "Weekday arithmetic", "eqS", "logic", 4),
    ("units", "Unit conversion", "eqS", "math", 5),
    ("compare", "Which number is larger", "eqO", "math", 2),
    ("word_order", "Alphabetical order", "eqO", "language", 3),
    ("letters", "Letter counting", "eqO", "language", 4),
]
LEG_WEIGHTS = {"public": 0.20, "eqS": 0.50, "eqO": 0.30}
POSITIONAL_SHARE = 0.85  # share of sorted_max questions built in ascending order


def _distinct(rng: random.Random, answer: int, k: int, spread: int, minimum: int | None = None) -> list[int]:
    """`answer` plus k-1 distinct distractors within `spread` of it (and >= `minimum`)."""
    out = [answer]
    while len(out) < k:
        cand = answer + rng.randint(-spread, spread)
        if cand not in out and (minimum is None or cand >= minimum):
            out.append(cand)
    return out


def _shuffled(rng: random.Random, gold: str, options: list[str]) -> tuple[list[str], int]:
    opts = list(options)
    rng.shuffle(opts)
    return opts, opts.index(gold)


def _q_arith(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    op = rng.choice("+-*")
    ans = a + b if op == "+" else a - b if op == "-" else a * b
    wrong = _distinct(rng, ans, 4, max(10, abs(ans) // 5))
    opts, gold = _shuffled(rng, str(ans), [str(x) for x in wrong])
    return f"What is {a} {op} {b}?", opts, gold


def _q_capitals(rng: random.Random) -> tuple[str, list[str], int]:
    country = rng.choice(sorted(CAPITALS))
    gold = CAPITALS[country]
    others = rng.sample(sorted(v for v in CAPITALS.values() if v != gold), 3)
    opts, g = _shuffled(rng, gold, [gold, *others])
    return f"What is the capital of {country}?", opts, g


def _q_sorted_max(rng: random.Random) -> tuple[str, list[str], int]:
    nums = rng.sample(range(100, 999), 4)
    if rng.random() < POSITIONAL_SHARE:
        nums.sort()
    else:
        rng.shuffle(nums)
    return "Which of these numbers is the largest?", [str(n) for n in nums], nums.index(max(nums))


def _q_boolean(rng: random.Random) -> tuple[str, list[str], int]:
    vals = [rng.choice([True, False]) for _ in range(3)]
    ops = [rng.choice(["and", "or"]) for _ in range(2)]
    neg = rng.random() < 0.5
    expr = f"{vals[0]} {ops[0]} {vals[1]} {ops[1]} {vals[2]}"
    if neg:
        expr = f"not ({vals[0]} {ops[0]} {vals[1]}) {ops[1]} {vals[2]}"
    value = bool(eval(expr))  # noqa: S307 - the expression is built above from literals only
    return f"What is the value of the Python expression: {expr}?", ["True", "False"], 0 if value else 1


def _q_weekdays(rng: random.Random) -> tuple[str, list[str], int]:
    start, days = rng.randrange(7), rng.randint(1, 40)
    gold = WEEKDAYS[(start + days) % 7]
    others = rng.sample([d for d in WEEKDAYS if d != gold], 3)
    opts, g = _shuffled(rng, gold, [gold, *others])
    return f"If today is {WEEKDAYS[start]}, what day of the week is it {days} days from now?", opts, g


def _q_units(rng: random.Random) -> tuple[str, list[str], int]:
    big, small, factor = rng.choice(UNITS)
    qty = rng.randint(2, 40) / 2
    ans = qty * factor
    # distractors: off by a factor of ten either way, and off by one or half a unit
    values = [ans, ans / 10, ans * 10, ans + factor, ans + factor / 2]
    opts, g = _shuffled(rng, f"{ans:g}", [f"{v:g}" for v in values])
    return f"How many {small} are in {qty:g} {big}?", opts, g


def _q_compare(rng: random.Random) -> tuple[str, list[str], int]:
    a = rng.randint(1000, 9999)
    digits = list(str(a))
    i, j = rng.sample(range(4), 2)
    digits[i], digits[j] = digits[j], digits[i]
    b = int("".join(digits))
    if b == a:
        b = a + rng.randint(1, 9)
    opts = [str(a), str(b)]
    return f"Which number is larger: {a} or {b}?", opts, opts.index(str(max(a, b)))


def _q_word_order(rng: random.Random) -> tuple[str, list[str], int]:
    words = rng.sample(WORDS, 3)
    opts, g = _shuffled(rng, min(words), words)
    return "Which word comes first in alphabetical order?", opts, g


def _q_letters(rng: random.Random) -> tuple[str, list[str], int]:
    word = rng.choice(WORDS)
    ans = len(word)
    opts, g = _shuffled(rng, str(ans), [str(x) for x in _distinct(rng, ans, 4, 3, minimum=1)])
    return f"How many letters are in the word '{word}'?", opts, g


GENERATORS: dict[str, Callable[[random.Random], tuple[str, list[str], int]]] = {
    "arith": _q_arith, "capitals": _q_capitals, "sorted_max": _q_sorted_max, "boolean": _q_boolean,
    "weekdays": _q_weekdays, "units": _q_units, "compare": _q_compare, "word_order": _q_word_order,
    "letters": _q_letters,
}


def _rows_per_catalog(total: int) -> list[int]:
    base, extra = divmod(total, len(CATALOGS))
    return [base + (1 if i < extra else 0) for i in range(len(CATALOGS))]


def write_sample_suite(out_dir: str | Path, *, rows: int = 360, seed: int = 0) -> Path:
    """Write `suite.toml` and `rows/<catalog>.jsonl` under `out_dir`; returns the suite folder."""
    if rows < 2 * len(CATALOGS):
        raise ValueError(f"--rows must be at least {2 * len(CATALOGS)}")
    out = Path(out_dir)
    (out / "rows").mkdir(parents=True, exist_ok=True)
    for (cid, _name, _leg, _area, k), n in zip(CATALOGS, _rows_per_catalog(rows), strict=True):
        rng = random.Random(f"jex-sample:{seed}:{cid}")
        with atomic_open(out / "rows" / f"{cid}.jsonl") as f:
            written, q = 0, 0
            while written < n:
                prompt, options, gold = GENERATORS[cid](rng)
                assert len(options) == k, (cid, options)
                variants = [(options, gold)]
                if written + 1 < n and rng.random() < 0.5 and cid != "sorted_max":
                    order = list(range(k))
                    rng.shuffle(order)
                    variants.append(([options[i] for i in order], order.index(gold)))
                for v, (opts, g) in enumerate(variants):
                    row = {"run_id": f"{cid}-{q:06d}-{v}", "catalog": cid, "question_id": f"{cid}-{q:06d}",
                           "prompt": prompt, "options": opts, "labels": list(LABELS[:k]), "gold": g}
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
                    written += 1
                q += 1
    manifest = {"name": "jex-sample", "legs": LEG_WEIGHTS,
                "catalogs": [{"id": cid, "name": name, "leg": leg, "area": area, "weight": 1.0,
                              "files": [f"rows/{cid}.jsonl"]} for cid, name, leg, area, _k in CATALOGS]}
    write_toml(out / "suite.toml", manifest, comment=f"generated by `jex suite sample --rows {rows} --seed {seed}`")
    return out

#!/usr/bin/env python3
"""The held-out tiered test set of issue 37, written apart from the training generator.

Four tiers of 500 problems each, committed as eval/data/tiers/<tier>.jsonl ({question, answer,
tier, kind}):

  indist      tools/data/gsm2.py's own families and phrasings, from its held-out draw (the
              training split never contains these questions): what the model was trained on;
  paraphrase  the same kinds of arithmetic as the training families (counts that change, shopping,
              more / fewer, equal shares, rates, averages, percentages, working backwards) in
              sentences, names, objects and question forms the training generator never uses;
  newstruct   problem structures the training generator has no family for (ratios, unit prices
              from a total, arithmetic sequences, profit, equalising transfers, ages in the
              future, combined rates, trips with stops);
  bignum      paraphrase-style problems with four- to six-digit numbers and results up to
              hundreds of millions, outside the training ranges.

This file is never imported by training code (tools/train, tools/data); tests/e2e/test_gsm2_split.py
checks that, and that no question here appears in a large sample of training output.

    python3 eval/gsm_tiers.py --write            (re-writes eval/data/tiers/*.jsonl)
    python3 eval/gsm_tiers.py --show paraphrase 3
"""
import argparse
import json
import os
import random
import sys
from fractions import Fraction

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TIER_DIR = os.path.join(HERE, "data", "tiers")
TIERS = ["indist", "paraphrase", "newstruct", "bignum"]
PER_TIER = 500
SEED = "tiers-37"

# Names, objects and places the training generator does not use.
NAMES_F = [("Ngozi", 1), ("Astrid", 1), ("Mirela", 1), ("Oksana", 1), ("Thandiwe", 1), ("Luz", 1),
           ("Freya", 1), ("Greta", 1), ("Soraya", 1), ("Imani", 1), ("Ximena", 1), ("Beatrix", 1)]
NAMES_M = [("Bjorn", 0), ("Tobiah", 0), ("Anselm", 0), ("Kwame", 0), ("Rafferty", 0), ("Lorcan", 0),
           ("Matteo", 0), ("Idris", 0), ("Soren", 0), ("Cormac", 0), ("Ilya", 0), ("Thiago", 0)]
OBJECTS = ["acorns", "feathers", "dominoes", "pinecones", "bottle caps", "paper cranes",
           "seed packets", "tennis balls", "jigsaw pieces", "chess pieces", "guitar picks",
           "bookmarks", "model trains", "glass jars", "sea stars", "walnuts", "magnets", "spoons"]
WARES = [("lantern", "lanterns"), ("teapot", "teapots"), ("scarf", "scarves"), ("umbrella", "umbrellas"),
         ("flashlight", "flashlights"), ("cushion", "cushions"), ("padlock", "padlocks"),
         ("thermos", "thermoses"), ("notepad", "notepads"), ("candle holder", "candle holders")]


class _Who:
    def __init__(self, name, female):
        self.name = name
        self.sub, self.pos, self.obj = ("she", "her", "her") if female else ("he", "his", "him")


def _people(rng, n):
    return [_Who(*x) for x in rng.sample(NAMES_F + NAMES_M, n)]


def _num(x):
    x = Fraction(x)
    if x.denominator == 1:
        return str(x.numerator)
    s = f"{float(x):.2f}".rstrip("0").rstrip(".")
    return s


class Skip(Exception):
    pass


# ------------------------------------------------------------------------------------------------
# paraphrase (and bignum with big=True): training kinds, new wording

def p_changes(rng, big):
    a, = _people(rng, 1)
    obj = rng.choice(OBJECTS)
    x = rng.randint(10_000, 90_000) if big else rng.randint(5, 90)
    s = [rng.choice([f"In {a.pos} drawer, {a.name} keeps {x} {obj}.", f"{a.name}'s shelf holds {x} {obj}.",
                     f"{a.name} collected {x} {obj} last year."])]
    cur = Fraction(x)
    for _ in range(rng.randint(1, 5)):
        k = rng.choice(["gain", "donate", "crates"])
        if k == "gain":
            d = rng.randint(1000, 50_000) if big else rng.randint(2, 40)
            s.append(rng.choice([f"Afterwards {a.sub} acquires {d} extra.", f"A neighbor hands {a.obj} {d} more.",
                                 f"{a.name} purchases an additional {d}."]))
            cur += d
        elif k == "donate":
            d = rng.randint(1, max(1, int(cur) - 1))
            s.append(rng.choice([f"Soon after, {a.sub} bestows {d} of them on a cousin.", f"{a.name} swaps {d} away for a comic.",
                                 f"{d} of them get misplaced."]))
            cur -= d
        else:
            n, m = (rng.randint(12, 99), rng.randint(101, 999)) if big else (rng.randint(2, 9), rng.randint(3, 25))
            s.append(rng.choice([f"Then {a.sub} brings home {n} cartons containing {m} apiece.",
                                 f"{a.name} also unpacks {n} sacks, every one holding {m}."]))
            cur += n * m
    s.append(rng.choice([f"What quantity does {a.name} retain at this point?", f"Tally the {obj} that survive all of this.",
                         f"Once all is said and done, how large is the stash of {obj}?"]))
    return " ".join(s), cur


def p_shop(rng, big):
    a, = _people(rng, 1)
    (s1, p1), (s2, p2) = rng.sample(WARES, 2)
    n1, n2 = rng.randint(2, 9), rng.randint(2, 9)
    c1, c2 = (rng.randint(1000, 9999), rng.randint(1000, 9999)) if big else (rng.randint(3, 45), rng.randint(3, 45))
    s = rng.choice([f"A market stall charges ${c1} per {s1} and ${c2} per {s2}. {a.name} picks {n1} {p1} and {n2} {p2}.",
                    f"{a.name} orders {n1} {p1} priced at ${c1} apiece, plus {n2} {p2} priced at ${c2} apiece."])
    tot = n1 * c1 + n2 * c2
    if rng.random() < 0.5:
        bill = (tot // 1000 + 1) * 1000 if big else ((tot // 100) + 1) * 100
        return s + f" {a.sub.capitalize()} settles the bill with ${bill}. What change is returned?", Fraction(bill - tot)
    return s + rng.choice([" What does the order come to?", " State the outlay."]), Fraction(tot)


def p_compare(rng, big):
    a, b = _people(rng, 2)
    obj = rng.choice(OBJECTS)
    x = rng.randint(10_000, 900_000) if big else rng.randint(10, 150)
    d = rng.randint(1, x - 1)
    if rng.random() < 0.5:
        y = x + d
        s = f"{a.name} owns {x} {obj}, while {b.name} owns {d} beyond that."
    else:
        y = x - d
        s = f"{a.name} owns {x} {obj}; {b.name} owns {d} short of that."
    q = rng.choice([f" Combined, what do the pair own?", f" What is the gap between their counts?",
                    f" How large is {b.name}'s pile?"])
    ans = x + y if "Combined" in q else abs(x - y) if "gap" in q else y
    return s + q, Fraction(ans)


def p_share(rng, big):
    a, = _people(rng, 1)
    obj = rng.choice(OBJECTS)
    k = rng.randint(3, 60) if big else rng.randint(2, 9)
    q = rng.randint(1000, 99_999) if big else rng.randint(3, 40)
    if rng.random() < 0.6:
        return (f"{a.name} divides {k * q} {obj} into {k} identical heaps. What is the size of a single heap?",
                Fraction(q))
    r = rng.randint(1, k - 1)
    return (f"{a.name} arranges {k * q + r} {obj} in rows of {k}, filling as many complete rows as possible. "
            f"How many {obj} are in the unfinished row?", Fraction(r))


def p_rate(rng, big):
    a, = _people(rng, 1)
    if rng.random() < 0.5:
        v, t = (rng.randint(100, 999), rng.randint(100, 999)) if big else (rng.randint(4, 70), rng.randint(2, 9))
        return (f"A drone glides {v} meters each minute without slowing. What distance does it cover in {t} minutes?",
                Fraction(v * t))
    w, h = (rng.randint(100, 999), rng.randint(100, 999)) if big else (rng.randint(9, 35), rng.randint(3, 40))
    return (f"{a.name} is paid ${w} for every hour on the job. Last month {a.sub} logged {h} hours. "
            f"What were {a.pos} earnings?", Fraction(w * h))


def p_average(rng, big):
    a, = _people(rng, 1)
    n = rng.randint(3, 5)
    vals = [rng.randint(1000, 99_999) if big else rng.randint(20, 99) for _ in range(n)]
    if sum(vals) % n:
        vals[-1] += n - sum(vals) % n
    return (f"Across {n} weekends {a.name}'s bakery sold " + ", ".join(map(str, vals[:-1])) + f", then {vals[-1]} "
            f"loaves. What was the mean number sold per weekend?", Fraction(sum(vals), n))


def p_percent(rng, big):
    pct = rng.choice([10, 20, 25, 40, 50, 75])
    n = rng.randint(100, 9999) * 20 if big else rng.randint(2, 40) * 20
    if rng.random() < 0.5:
        return (f"A survey reached {n} households, and {pct} percent of them own a bicycle. Exactly how many households "
                f"own one?", Fraction(n * pct, 100))
    return (f"An item listed at ${n} is marked down by {pct} percent. What does it sell for after the markdown?",
            Fraction(n * (100 - pct), 100))


def p_back(rng, big):
    a, = _people(rng, 1)
    obj = rng.choice(OBJECTS)
    start = rng.randint(10_000, 90_000) if big else rng.randint(10, 90)
    d1 = rng.randint(1, start - 1)
    d2 = rng.randint(1000, 9999) if big else rng.randint(1, 30)
    end = start - d1 + d2
    return (f"{a.name} handed {d1} {obj} to a friend and later found {d2} more. {a.sub.capitalize()} now has {end}. "
            f"What was {a.pos} original number of {obj}?", Fraction(start))


PARA = [p_changes, p_shop, p_compare, p_share, p_rate, p_average, p_percent, p_back]


# ------------------------------------------------------------------------------------------------
# newstruct: structures the training generator has no family for

def n_ratio(rng):
    a, b = _people(rng, 2)
    r1, r2 = rng.randint(1, 5), rng.randint(1, 5)
    unit = rng.randint(2, 30)
    tot = (r1 + r2) * unit
    return (f"{a.name} and {b.name} split ${tot} in the ratio {r1}:{r2}. What is {b.name}'s share in dollars?",
            Fraction(r2 * unit))


def n_unit_price(rng):
    a, = _people(rng, 1)
    s, p = rng.choice(WARES)
    n, c, m = rng.randint(2, 9), rng.randint(2, 30), rng.randint(2, 12)
    return (f"{n} {p} cost ${n * c} altogether. At the same price, what would {m} {p} cost {a.name}?",
            Fraction(m * c))


def n_sequence(rng):
    a, = _people(rng, 1)
    first, inc, days = rng.randint(2, 20), rng.randint(1, 6), rng.randint(3, 7)
    tot = sum(first + inc * i for i in range(days))
    return (f"{a.name} solves {first} puzzles on the first day and each day solves {inc} more than the day before. "
            f"What is {a.pos} puzzle total after {days} days?", Fraction(tot))


def n_profit(rng):
    a, = _people(rng, 1)
    s, p = rng.choice(WARES)
    buy, margin, n = rng.randint(3, 40), rng.randint(1, 20), rng.randint(3, 30)
    return (f"{a.name} buys {p} wholesale at ${buy} a piece and resells every one for ${buy + margin}. "
            f"What profit does {a.sub} make on {n} of them?", Fraction(margin * n))


def n_equalize(rng):
    a, b = _people(rng, 2)
    obj = rng.choice(OBJECTS)
    y, d = rng.randint(5, 60), rng.randint(1, 20)
    x = y + 2 * d
    return (f"{a.name} counts {x} {obj} in a tin, {b.name} only {y}. How many must {a.name} give {b.name} so that both have "
            f"the same number?", Fraction(d))


def n_future_age(rng):
    a, b = _people(rng, 2)
    x, gap, yrs = rng.randint(3, 40), rng.randint(1, 30), rng.randint(2, 15)
    return (f"{a.name} is {x}, and {b.name} was born {gap} years before {a.name}. What will be the sum of their ages "
            f"once {yrs} more years have passed?", Fraction(x + yrs + x + gap + yrs))


def n_combined(rng):
    r1, r2 = rng.randint(2, 20), rng.randint(2, 20)
    t = rng.randint(2, 12)
    tot = (r1 + r2) * t
    return (f"Pump A drains {r1} liters a minute and pump B drains {r2} liters a minute. Working together, how many "
            f"minutes do they need to empty a tank holding {tot} liters?", Fraction(t))


def n_trip(rng):
    a, = _people(rng, 1)
    legs = [rng.randint(5, 80) for _ in range(rng.randint(2, 4))]
    back = rng.randint(1, sum(legs) - 1)
    return (f"On a road trip {a.name} drives legs of " + ", ".join(map(str, legs)) + " km, then turns around and "
            f"drives {back} km back toward home. How far from home is {a.sub} now, in km?",
            Fraction(sum(legs) - back))


NEW = [n_ratio, n_unit_price, n_sequence, n_profit, n_equalize, n_future_age, n_combined, n_trip]


# ------------------------------------------------------------------------------------------------

def build_tier(tier, n=PER_TIER):
    if tier == "indist":
        sys.path.insert(0, os.path.join(REPO, "tools", "data"))
        import gsm2

        return [{"question": p["question"], "answer": p["answer"], "tier": tier, "kind": p["family"]}
                for p in gsm2.make_problems("heldout", n, 0, with_template=True)]
    rng = random.Random(f"{SEED}:{tier}")
    out, seen = [], set()
    while len(out) < n:
        if tier == "newstruct":
            fn = rng.choice(NEW)
            q, ans = fn(rng)
        else:
            fn = rng.choice(PARA)
            q, ans = fn(rng, tier == "bignum")
        if q in seen:
            continue
        seen.add(q)
        out.append({"question": q, "answer": _num(ans), "tier": tier, "kind": fn.__name__})
    return out


def tier_path(tier):
    return os.path.join(TIER_DIR, f"{tier}.jsonl")


def load_tier(tier):
    with open(tier_path(tier)) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="write eval/data/tiers/*.jsonl")
    ap.add_argument("--show", nargs=2, metavar=("TIER", "N"))
    a = ap.parse_args(argv)
    if a.write:
        os.makedirs(TIER_DIR, exist_ok=True)
        for t in TIERS:
            probs = build_tier(t)
            with open(tier_path(t), "w") as f:
                for p in probs:
                    f.write(json.dumps(p) + "\n")
            print(f"wrote {len(probs)} problems to {tier_path(t)}")
    if a.show:
        for p in build_tier(a.show[0])[: int(a.show[1])]:
            print(json.dumps(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())

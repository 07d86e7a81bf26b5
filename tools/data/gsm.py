#!/usr/bin/env python3
"""Synthetic GSM8K-style word problems for training and evaluating small Kimi-K3 models.

Each problem takes 2 to 4 steps of arithmetic. The worked solution spells every step as
`<short clause> a op b = c.` (op in + - * /) so that a small model only ever has to compute one
binary operation per step, and ends with a `#### N` line like GSM8K. Every number in a question or
a solution is a non-negative integer below 1000 and every division is exact.

Text format (the trainer, gsm_eval.py and the lm-eval task all depend on it):
    format_example(p) = "Question: " + q + "\\nAnswer: " + solution + "\\n#### " + str(answer)
    examples are joined by "\\n\\n"; a generation stops at "\\n\\n".

Splits: "test" is a fixed set of 1,319 problems (TEST_SEED); "train" is drawn from any seed and
never contains a question of the test set (compared after normalisation).

CLI:
    python3 tools/data/gsm.py --split test --out tools/data/gsm_test.jsonl
    python3 tools/data/gsm.py --split train --n 5 --seed 1          (prints formatted examples)
    python3 tools/data/gsm.py --fewshot-out tools/data/gsm_fewshot.jsonl
    python3 tools/data/gsm.py --self-check 20000                    (verifies every solution)
"""
import argparse
import json
import os
import random
import re
import sys

TEST_SIZE = 1319  # the size of GSM8K's test split, so the numbers read the same
TEST_SEED = 8_1319
FEWSHOT_SEED = 4_0404
MAX_VALUE = 999  # every number in a problem stays below 1000

# ------------------------------------------------------------------------------------------------
# Word pools. Names carry their pronouns so that sentences can refer back to the person.

_F = ["Mia", "Emma", "Olivia", "Ava", "Sofia", "Lily", "Chloe", "Grace", "Zoe", "Nora", "Hannah",
      "Ella", "Ruby", "Alice", "Maya", "Leah", "Sara", "Julia", "Rosa", "Anna", "Priya", "Aisha",
      "Mei", "Fatima", "Elena", "Nina", "Ivy", "Lucy", "Clara", "Jade", "Amara", "Hana", "Isla",
      "Tara", "Vera", "Wendy"]
_M = ["Leo", "Noah", "Liam", "Ethan", "Lucas", "Mason", "Owen", "Jack", "Ben", "Sam", "Max",
      "Omar", "Ravi", "Kenji", "Diego", "Tom", "Adam", "Eli", "Hugo", "Felix", "Oscar", "Marco",
      "Jamal", "Ali", "Theo", "Finn", "Caleb", "Luis", "Ivan", "Yusuf", "Arjun", "Kofi", "Pablo",
      "Victor", "Henry", "Carlos"]

# (singular, plural) of small things people own, buy and give away
ITEMS = [("apple", "apples"), ("orange", "oranges"), ("pear", "pears"), ("lemon", "lemons"),
         ("marble", "marbles"), ("sticker", "stickers"), ("pencil", "pencils"),
         ("crayon", "crayons"), ("marker", "markers"), ("eraser", "erasers"),
         ("trading card", "trading cards"), ("stamp", "stamps"), ("shell", "shells"),
         ("bead", "beads"), ("button", "buttons"), ("coin", "coins"), ("balloon", "balloons"),
         ("cookie", "cookies"), ("cupcake", "cupcakes"), ("toy car", "toy cars"),
         ("comic book", "comic books"), ("rock", "rocks"), ("candle", "candles"),
         ("ribbon", "ribbons"), ("postcard", "postcards"), ("paper clip", "paper clips"),
         ("plum", "plums"), ("peach", "peaches"), ("candy", "candies"), ("badge", "badges"),
         ("key chain", "key chains"), ("puzzle", "puzzles")]
CONTAINERS = [("bag", "bags"), ("box", "boxes"), ("pack", "packs"), ("jar", "jars"),
              ("basket", "baskets"), ("crate", "crates"), ("bundle", "bundles"), ("tin", "tins"),
              ("carton", "cartons"), ("bucket", "buckets")]
BAKED = ["cookies", "muffins", "cupcakes", "brownies", "rolls", "biscuits", "scones", "tarts",
         "buns", "pies"]
FRUIT = ["apples", "oranges", "plums", "pears", "peaches", "lemons", "strawberries", "cherries",
         "limes", "apricots"]
PLANTS = ["tomato", "pepper", "lettuce", "carrot", "bean", "sunflower", "rose", "tulip",
          "cabbage", "onion", "pumpkin", "daisy"]
PURCHASES = ["bike", "video game", "jacket", "backpack", "watch", "lamp", "kite", "scooter",
             "guitar", "tent", "camera", "skateboard", "pair of shoes", "phone case"]
GOODS = ["notebooks", "pens", "sandwiches", "bottles of juice", "cups of coffee", "rulers",
         "bags of chips", "bananas", "hats", "pairs of socks", "candles", "mugs", "T-shirts",
         "plates", "towels", "bowls of soup"]
JOBS = ["babysitting", "walking dogs", "mowing lawns", "washing cars", "tutoring",
        "working at the bakery", "delivering papers", "helping at the farm", "raking leaves"]
INSTRUMENTS = ["piano", "guitar", "violin", "drums", "flute", "cello", "trumpet", "harp"]
CLUBS = ["drama club", "chess club", "school band", "soccer team", "art class", "science club",
         "choir", "book club"]
SUPPLIES = ["decorations", "snacks", "posters", "costumes", "printing", "prizes"]
TEAMS = ["Tigers", "Hawks", "Lions", "Bears", "Wolves", "Eagles", "Sharks", "Rockets", "Comets",
         "Falcons"]
SPORTS = ["basketball", "football", "hockey", "volleyball", "rugby", "handball"]
ANIMALS4 = ["cows", "pigs", "goats", "sheep", "horses", "dogs", "donkeys", "rabbits"]
ANIMALS2 = ["chickens", "ducks", "geese", "turkeys", "hens", "parrots"]
VEHICLES = [("bicycles", 2), ("cars", 4), ("tricycles", 3), ("motorbikes", 2), ("wagons", 4)]
FISH = ["goldfish", "guppies", "tetras", "angelfish", "clownfish", "mollies"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
VESSELS = ["bus", "train", "tram", "ferry", "shuttle"]
PLACES = ["zoo", "museum", "cinema", "aquarium", "water park", "circus", "science fair"]
FIELDS = ["garden", "field", "playground", "yard", "parking lot", "pool deck", "farm plot"]

FRACTIONS = [("half", 2), ("a third", 3), ("a quarter", 4)]


class Reject(Exception):
    """A drawn problem broke a constraint (negative, too big, inexact division); draw again."""


class Person:
    def __init__(self, name, female):
        self.name = name
        self.sub = "she" if female else "he"
        self.obj = "her" if female else "him"
        self.pos = "her" if female else "his"


def cap(s):
    return s[:1].upper() + s[1:]


class Gen:
    """Random helpers for one problem, plus the worked solution being built."""

    def __init__(self, rng):
        self.rng = rng
        self.steps = []
        self.last = None
        self._used_names = set()

    def r(self, lo, hi):
        return self.rng.randint(lo, hi)

    def pick(self, seq):
        return self.rng.choice(seq)

    def person(self):
        for _ in range(100):
            female = self.rng.random() < 0.5
            name = self.pick(_F if female else _M)
            if name not in self._used_names:
                self._used_names.add(name)
                return Person(name, female)
        raise Reject("names")

    def op(self, clause, a, sym, b, unit=""):
        """Appends the step `clause a sym b = c unit.` and returns c."""
        if sym == "+":
            c = a + b
        elif sym == "-":
            c = a - b
        elif sym == "*":
            c = a * b
        elif sym == "/":
            if b == 0 or a % b:
                raise Reject("inexact division")
            c = a // b
        else:
            raise ValueError(sym)
        if not (0 <= a <= MAX_VALUE and 0 <= b <= MAX_VALUE and 0 <= c <= MAX_VALUE):
            raise Reject("out of range")
        tail = " " + unit if unit else ""
        self.steps.append(f"{cap(clause)} {a} {sym} {b} = {c}{tail}.")
        self.last = c
        return c


# ------------------------------------------------------------------------------------------------
# Templates. Each takes a Gen, appends its steps and returns the question text; the answer is the
# result of the last step. Phrasings are drawn per sentence, so each template reads many ways.

def t_buy_bags_give(g):
    p, f = g.person(), g.person()
    s, pl = g.pick(ITEMS)
    cs, cp = g.pick(CONTAINERS)
    a, b, c, d = g.r(3, 60), g.r(2, 9), g.r(3, 15), g.r(2, 40)
    q = g.pick([f"{p.name} has {a} {pl}.", f"{p.name} owns {a} {pl}.",
                f"{p.name} starts with {a} {pl}."])
    q += " " + g.pick([f"{cap(p.sub)} buys {b} {cp} with {c} {pl} in each {cs}.",
                       f"{cap(p.sub)} buys {b} {cp} of {pl}, and each {cs} holds {c} {pl}.",
                       f"Then {p.sub} gets {b} more {cp}, each with {c} {pl}."])
    n = g.op(f"the {cp} hold", b, "*", c, pl)
    x = g.op(f"{p.name} then has", a, "+", n, pl)
    if g.r(0, 2):
        q += " " + g.pick([f"Then {p.sub} gives {d} {pl} to {f.name}.",
                           f"Later {p.sub} gives {f.name} {d} {pl}.",
                           f"{cap(p.sub)} gives away {d} {pl}."])
        g.op(f"after giving some away {p.sub} has", x, "-", d, pl)
    q += " " + g.pick([f"How many {pl} does {p.name} have now?",
                       f"How many {pl} does {p.name} have in the end?",
                       f"How many {pl} does {p.name} end up with?"])
    return q


def t_shop_cost(g):
    p = g.person()
    g1, g2 = g.rng.sample(GOODS, 2)
    a, pa, b, pb = g.r(2, 9), g.r(2, 25), g.r(2, 9), g.r(2, 25)
    q = g.pick([f"{p.name} buys {a} {g1} for ${pa} each and {b} {g2} for ${pb} each.",
                f"At the store, {p.name} gets {a} {g1} at ${pa} each and {b} {g2} at ${pb} each.",
                f"{g1.capitalize()} cost ${pa} each and {g2} cost ${pb} each. "
                f"{p.name} buys {a} {g1} and {b} {g2}."])
    x = g.op(f"the {g1} cost", a, "*", pa, "dollars")
    y = g.op(f"the {g2} cost", b, "*", pb, "dollars")
    if g.r(0, 1):
        bill = g.pick([50, 100, 200, 500])
        z = g.op("together that is", x, "+", y, "dollars")
        if bill < z:
            raise Reject("bill")
        q += " " + g.pick([f"{cap(p.sub)} pays with a ${bill} bill. "
                           f"How much change does {p.sub} get?",
                           f"{cap(p.sub)} hands the cashier ${bill}. "
                           f"How many dollars of change should {p.sub} get back?"])
        g.op("the change is", bill, "-", z, "dollars")
    else:
        q += " " + g.pick([f"How much does {p.name} spend in total?",
                           f"How many dollars does {p.name} pay altogether?"])
        g.op(f"{p.name} pays", x, "+", y, "dollars")
    return q


def t_savings(g):
    p = g.person()
    s, w, a, b = g.r(3, 40), g.r(2, 12), g.r(5, 90), g.r(10, 99)
    thing = g.pick(PURCHASES)
    per = g.pick(["week", "month"])
    q = g.pick([f"{p.name} has ${a} in a piggy bank. {cap(p.sub)} saves ${s} every {per} "
                f"for {w} {per}s.",
                f"{p.name} already has ${a}. Each {per}, {p.sub} puts ${s} more into savings, "
                f"and {p.sub} does this for {w} {per}s.",
                f"For {w} {per}s, {p.name} saves ${s} a {per}. Before that {p.sub} had ${a}."])
    x = g.op(f"{p.sub} saves", s, "*", w, "dollars")
    y = g.op("with the money from before that is", a, "+", x, "dollars")
    if g.r(0, 2):
        q += " " + g.pick([f"Then {p.sub} buys a {thing} for ${b}.",
                           f"{cap(p.sub)} spends ${b} on a {thing}."])
        q += " " + g.pick([f"How much money does {p.name} have left?",
                           f"How many dollars does {p.name} have now?"])
        g.op(f"after buying the {thing} {p.sub} has", y, "-", b, "dollars")
    else:
        q += " " + g.pick([f"How much money does {p.name} have now?",
                           f"How many dollars does {p.name} have in total?"])
    return q


def t_ages(g):
    a, b, c = g.person(), g.person(), g.person()
    x, y = g.r(4, 60), g.r(2, 30)
    fw, k = g.pick(FRACTIONS)
    q = g.pick([f"{a.name} is {x} years old. {b.name} is {y} years older than {a.name}.",
                f"{a.name} is {x}. {b.name} is {y} years older than {a.name}.",
                f"{b.name} is {y} years older than {a.name}, who is {x} years old."])
    bx = g.op(f"{b.name} is", x, "+", y, "years old")
    mode = g.r(0, 2)
    if mode == 0:
        q += f" {c.name} is {fw} as old as {b.name}. How old is {c.name}?"
        g.op(f"{c.name} is", bx, "/", k, "years old")
    elif mode == 1:
        q += f" {c.name} is {fw} as old as {b.name}. What is the sum of the three ages?"
        cx = g.op(f"{c.name} is", bx, "/", k, "years old")
        s = g.op(f"{a.name} and {b.name} together are", x, "+", bx, "years")
        g.op("all three together are", s, "+", cx, "years")
    else:
        n = g.r(2, 20)
        q += " " + g.pick([f"How old will {b.name} be in {n} years?",
                           f"How old is {b.name} going to be {n} years from now?"])
        g.op(f"in {n} years {b.name} will be", bx, "+", n, "years old")
    return q


def t_distance(g):
    p = g.person()
    unit = g.pick(["miles", "kilometers"])
    how = g.pick([("drives", "driving", 25, 70), ("rides a horse", "riding", 5, 15),
                  ("cycles", "cycling", 8, 25), ("sails", "sailing", 5, 30)])
    v, h, d = g.r(how[2], how[3]), g.r(2, 9), g.r(3, 60)
    q = g.pick([f"{p.name} {how[0]} at {v} {unit} per hour for {h} hours.",
                f"For {h} hours, {p.name} {how[0]} at a speed of {v} {unit} per hour."])
    q += " " + g.pick([f"Then {p.sub} walks another {d} {unit}.",
                       f"After that {p.sub} still has to walk {d} {unit}.",
                       f"Then {p.sub} goes {d} more {unit} on foot."])
    x = g.op(f"{how[1]} covers", v, "*", h, unit)
    y = g.op("adding the walk gives", x, "+", d, unit)
    if g.r(0, 1):
        e = g.r(2, 40)
        q += (f" On the way home {p.sub} takes a shorter road that is {e} {unit} shorter."
              f" How many {unit} does {p.sub} travel there and back?")
        back = g.op("the way home is", y, "-", e, unit)
        g.op("there and back is", y, "+", back, unit)
    else:
        q += " " + g.pick([f"How many {unit} does {p.name} travel in total?",
                           f"How far does {p.name} go altogether, in {unit}?"])
    return q


def t_bake_share(g):
    p = g.person()
    food = g.pick(BAKED)
    t, c, f = g.r(2, 8), g.r(4, 24), g.r(2, 9)
    x = t * c
    eats = [e for e in range(1, 20) if e < x and (x - e) % f == 0]
    if not eats:
        raise Reject("share")
    e = g.pick(eats)
    q = g.pick([f"{p.name} bakes {t} trays of {food} with {c} {food} on each tray.",
                f"{p.name} makes {t} batches of {food}, and each batch has {c} {food}.",
                f"On Sunday {p.name} bakes {food}: {t} trays with {c} on each tray."])
    q += " " + g.pick([f"{cap(p.sub)} eats {e} of them and shares the rest equally among "
                       f"{f} friends. How many {food} does each friend get?",
                       f"{cap(p.sub)} keeps {e} for {p.obj}self and splits the rest evenly "
                       f"between {f} neighbors. How many {food} does each neighbor get?"])
    n = g.op(f"{p.sub} bakes", t, "*", c, food)
    m = g.op("after keeping some there are", n, "-", e, food)
    g.op("each one gets", m, "/", f, food)
    return q


def t_classroom(g):
    room, seat, people = g.pick([("classroom", "desks", "students"),
                                 ("lecture hall", "seats", "students"),
                                 ("exam room", "desks", "pupils"), ("theater", "seats", "guests"),
                                 ("meeting room", "chairs", "workers"),
                                 ("chapel", "pews", "visitors"), ("cafe", "stools", "customers")])
    r, c = g.r(3, 20), g.r(3, 20)
    total = r * c
    if total > MAX_VALUE:
        raise Reject("seats")
    s = g.r(max(2, total // 3), total)
    t = g.person()
    q = g.pick([f"A {room} has {r} rows of {seat} with {c} {seat} in each row.",
                f"In a {room} the {seat} stand in {r} rows, and every row has {c} {seat}.",
                f"{t.name} sets up {r} rows of {c} {seat} in a {room}."])
    q += " " + g.pick([f"There are {s} {people} in the {room}.", f"{s} {people} come in."])
    n = g.op("there are", r, "*", c, seat)
    if g.r(0, 1):
        k = g.r(1, max(1, s - 2))
        q += " " + g.pick([f"Then {k} {people} leave. How many {seat} are empty now?",
                           f"After a break {k} {people} do not come back. "
                           f"How many {seat} are empty after the break?"])
        here = g.op(f"the {people} still there are", s, "-", k, people)
        g.op(f"the empty {seat} are", n, "-", here, seat)
    else:
        q += " " + g.pick([f"How many {seat} are empty?", f"How many {seat} are not used?"])
        g.op(f"the empty {seat} are", n, "-", s, seat)
    return q


def t_garden(g):
    p = g.person()
    plant = g.pick(PLANTS)
    r, c, k, m = g.r(2, 12), g.r(3, 20), g.r(2, 15), g.r(2, 30)
    q = g.pick([f"{p.name} plants {r} rows of {plant} plants with {c} plants in each row.",
                f"In {p.pos} garden, {p.name} puts {c} {plant} plants in each of {r} rows."])
    n = g.op("the rows hold", r, "*", c, "plants")
    q += " " + g.pick([f"{k} of the plants do not grow.", f"Rabbits eat {k} of the plants.",
                       f"A storm ruins {k} of them."])
    x = g.op("the plants left are", n, "-", k, "plants")
    if g.r(0, 1):
        q += f" Then {p.sub} plants {m} more."
        g.op("with the new ones there are", x, "+", m, "plants")
    q += " " + g.pick([f"How many {plant} plants does {p.name} have now?",
                       f"How many {plant} plants are in the garden now?"])
    return q


def t_reading(g):
    p = g.person()
    r, d = g.r(5, 40), g.r(2, 9)
    P = g.r(r * d + 10, min(MAX_VALUE, r * d + 400))
    q = g.pick([f"{p.name}'s book has {P} pages. {cap(p.sub)} reads {r} pages every day "
                f"for {d} days.",
                f"{p.name} is reading a {P}-page book. For {d} days {p.sub} reads {r} pages "
                "a day."])
    x = g.op(f"{p.sub} reads", r, "*", d, "pages")
    if g.r(0, 1):
        k = g.pick([2, 3])
        kw = {2: "twice", 3: "three times"}[k]
        q += (f" The next day {p.sub} reads {kw} as many pages as on each of those days."
              " How many pages are left to read?")
        t = g.op("the next day is", k, "*", r, "pages")
        tot = g.op("so far that is", x, "+", t, "pages")
        g.op("the pages left are", P, "-", tot, "pages")
    else:
        q += " " + g.pick([f"How many pages does {p.sub} still have to read?",
                           "How many pages are left?"])
        g.op("the pages left are", P, "-", x, "pages")
    return q


def t_fruit_days(g):
    p = g.person()
    fruit = g.pick(FRUIT)
    a, k, d = g.r(4, 60), g.r(2, 5), g.r(2, 30)
    i = g.r(0, 4)
    d1, d2, d3 = WEEKDAYS[i:i + 3]  # three days in a row, in order
    kw = {2: "twice", 3: "three times", 4: "four times", 5: "five times"}[k]
    q = (f"{p.name} picks {a} {fruit} on {d1}. On {d2} {p.sub} picks {kw} as many. "
         f"On {d3} {p.sub} picks {d} fewer than on {d2}.")
    q += " " + g.pick([f"How many {fruit} does {p.name} pick in all?",
                       f"How many {fruit} does {p.sub} pick over the three days?"])
    t = g.op(f"on {d2} {p.sub} picks", a, "*", k, fruit)
    w = g.op(f"on {d3} {p.sub} picks", t, "-", d, fruit)
    s = g.op("the first two days give", a, "+", t, fruit)
    g.op("all three days give", s, "+", w, fruit)
    return q


def t_job(g):
    p, f = g.person(), g.person()
    job = g.pick(JOBS)
    e, h = g.r(4, 25), g.r(2, 12)
    q = g.pick([f"{p.name} earns ${e} an hour {job}.", f"{p.name} makes ${e} per hour {job}."])
    q += " " + g.pick([f"This week {p.sub} works {h} hours.", f"{cap(p.sub)} works for {h} hours."])
    x = g.op(f"{p.sub} earns", e, "*", h, "dollars")
    mode = g.r(0, 2)
    if mode == 0:
        s = g.r(2, 80)
        thing = g.pick(PURCHASES)
        q += (f" {cap(p.sub)} spends ${s} on a {thing}. "
              f"How much of {p.pos} pay does {p.sub} have left?")
        g.op("after buying it", x, "-", s, "dollars are left")
    elif mode == 1:
        k = g.r(2, 6)
        q += (f" {cap(p.sub)} puts the money equally into {k} envelopes. "
              "How much money is in each envelope?")
        g.op("each envelope gets", x, "/", k, "dollars")
    else:
        b = g.r(2, 30)
        q += (f" {cap(p.sub)} also gets a ${b} tip from {f.name}. "
              f"How much does {p.sub} make this week?")
        g.op("with the tip that is", x, "+", b, "dollars")
    return q


def t_legs(g):
    if g.r(0, 1):
        a4, a2 = g.pick(ANIMALS4), g.pick(ANIMALS2)
        x, y = g.r(2, 40), g.r(2, 60)
        who = g.pick(["A farmer has", "A small farm keeps", "At the petting zoo there are",
                      f"{g.person().name} looks after", f"{g.person().name}'s farm has",
                      "In a barnyard there are", "A show has"])
        q = (f"{who} {x} {a4} and {y} {a2}. "
             + g.pick(["How many legs do the animals have altogether?",
                       "How many legs are there in total?"]))
        m = g.op(f"the {a4} have", x, "*", 4, "legs")
        n = g.op(f"the {a2} have", y, "*", 2, "legs")
        g.op("altogether that is", m, "+", n, "legs")
    else:
        (v1, w1), (v2, w2) = g.rng.sample(VEHICLES, 2)
        x, y = g.r(2, 40), g.r(2, 40)
        where = g.pick(["a parking area", "a garage", "a repair shop", "a car park",
                        "a rental shop", "a showroom", f"{g.person().name}'s yard"])
        q = (f"In {where} there are {x} {v1} and {y} {v2}. "
             + g.pick(["How many wheels are there in all?", "How many wheels are there in total?"]))
        m = g.op(f"the {v1} have", x, "*", w1, "wheels")
        n = g.op(f"the {v2} have", y, "*", w2, "wheels")
        g.op("in all there are", m, "+", n, "wheels")
    return q


def t_pizza(g):
    p = g.person()
    food, unit = g.pick([("pizzas", "slices"), ("pies", "pieces"), ("cakes", "pieces"),
                         ("chocolate bars", "squares"), ("loaves of bread", "slices")])
    n, s = g.r(2, 9), g.r(4, 12)
    tot = n * s
    q = g.pick([f"{p.name} orders {n} {food}. Each is cut into {s} {unit}.",
                f"{p.name} buys {n} {food}, and each one has {s} {unit}."])
    x = g.op("there are", n, "*", s, unit)
    if g.r(0, 1):
        k = g.r(1, 9)
        if tot % (k + 1):
            raise Reject("share")
        q += (f" {cap(p.sub)} shares them equally with {k} friend{'s' if k > 1 else ''}. "
              f"How many {unit} does each person get?")
        ppl = g.op("the people are", k, "+", 1, "people")
        g.op("each person gets", x, "/", ppl, unit)
    else:
        e = g.r(2, tot - 1)
        q += f" The family eats {e} {unit}. How many {unit} are left?"
        g.op("the pieces left are" if unit == "pieces" else f"the {unit} left are", x, "-", e,
             unit)
    return q


def t_give_each(g):
    p = g.person()
    s, pl = g.pick(ITEMS)
    b, k = g.r(2, 12), g.r(2, 9)
    a = g.r(b * k + 1, min(MAX_VALUE, b * k + 80))
    q = g.pick([f"{p.name} has {a} {pl}. {cap(p.sub)} gives {b} {pl} to each of {k} friends.",
                f"{p.name} has {a} {pl} and gives {k} friends {b} {pl} each."])
    x = g.op(f"{p.sub} gives away", k, "*", b, pl)
    y = g.op(f"{p.sub} has", a, "-", x, f"{pl} left")
    if g.r(0, 1):
        c = g.r(2, 40)
        q += f" Then {p.sub} finds {c} more. How many {pl} does {p.sub} have now?"
        g.op(f"now {p.sub} has", y, "+", c, pl)
    else:
        q += " " + g.pick([f"How many {pl} does {p.sub} have left?",
                           f"How many {pl} does {p.name} keep?"])
    return q


def t_bus(g):
    v = g.pick(VESSELS)
    a, b, c, d = g.r(10, 80), g.r(2, 30), g.r(2, 30), g.r(2, 30)
    q = g.pick([f"A {v} starts with {a} passengers.",
                f"There are {a} people on a {v}."])
    q += f" At the first stop {b} people get off and {c} get on."
    x = g.op("after the first people leave there are", a, "-", b, "passengers")
    y = g.op("after the new people get on there are", x, "+", c, "passengers")
    if g.r(0, 1):
        q += f" At the second stop {d} people get off."
        g.op("after the second stop there are", y, "-", d, "passengers")
    q += " " + g.pick([f"How many passengers are on the {v} now?",
                       f"How many people are on the {v} now?"])
    return q


def t_library(g):
    place = g.pick(["school library", "town library", "bookshop", "book club"])
    a, b, c, d = g.r(40, 500), g.r(5, 80), g.r(2, 9), g.r(5, 30)
    q = (f"The {place} has {a} books. It "
         + g.pick([f"lends out {b} books", f"gives away {b} old books", f"sells {b} books"])
         + f" and then gets {c} boxes of new books with {d} books in each box. "
         + g.pick([f"How many books does the {place} have now?",
                   f"How many books are in the {place} now?"]))
    x = g.op("first it has", a, "-", b, "books")
    y = g.op("the boxes hold", c, "*", d, "books")
    g.op("now it has", x, "+", y, "books")
    return q


def t_compare3(g):
    a, b, c = g.person(), g.person(), g.person()
    s, pl = g.pick(ITEMS)
    x, k, d = g.r(3, 50), g.r(2, 6), g.r(2, 30)
    q = (f"{a.name} has {x} {pl}. {b.name} has {k} times as many {pl} as {a.name}.")
    bx = g.op(f"{b.name} has", x, "*", k, pl)
    if g.r(0, 1):
        q += (f" {c.name} has {d} fewer {pl} than {b.name}. "
              + g.pick([f"How many {pl} do the three of them have together?",
                        f"How many {pl} do they have in total?"]))
        cx = g.op(f"{c.name} has", bx, "-", d, pl)
        s2 = g.op(f"{a.name} and {b.name} have", x, "+", bx, pl)
        g.op("all three have", s2, "+", cx, pl)
    else:
        q += f" How many more {pl} does {b.name} have than {a.name}?"
        g.op(f"{b.name} has", bx, "-", x, f"more {pl}")
    return q


def t_tank(g):
    cont = g.pick(["tank", "pool", "barrel", "pond"])
    unit = g.pick(["liters", "gallons"])
    r, m = g.r(2, 30), g.r(2, 20)
    x = r * m
    T = g.r(x + 5, min(MAX_VALUE, x + 300))
    q = (f"A {cont} holds {T} {unit} of water. A hose fills it at {r} {unit} per minute.")
    n = g.op(f"in {m} minutes the hose adds", r, "*", m, unit)
    if g.r(0, 1):
        s = g.r(2, max(2, T - x))
        q += (f" The {cont} already has {s} {unit} in it. After {m} minutes, how many more "
              f"{unit} are needed to fill it?")
        y = g.op(f"the {cont} then has", s, "+", n, unit)
        g.op("still needed are", T, "-", y, unit)
    else:
        q += (f" The {cont} starts empty. After {m} minutes, how many more {unit} are needed "
              "to fill it?")
        g.op("still needed are", T, "-", n, unit)
    return q


def t_eggs(g):
    c = g.pick([6, 8, 10, 12, 15, 20])
    k, p = g.r(2, 40), g.r(2, 12)
    if k * c > MAX_VALUE:
        raise Reject("eggs")
    who = g.pick(["A farm", "A ranch", f"{g.person().name}'s family farm", "A small egg farm",
                  "A village co-op"])
    when = g.pick(["", " this week", " on Monday", " in one day", " this month"])
    if g.r(0, 1):
        x = g.r(2, 60)
        N = k * c + x
        q = (f"{who} collects {N} eggs{when}, but {x} of them "
             + g.pick(["break", "are cracked", "are too small to sell"])
             + f". The rest are packed in cartons of {c}. Each carton sells for ${p}. "
             + g.pick(["How much money does the farm make?",
                       "How many dollars do the cartons bring in?"]))
        N = g.op("the good eggs are", N, "-", x, "eggs")
    else:
        N = k * c
        q = (f"{who} collects {N} eggs{when}. "
             + g.pick([f"They are packed in cartons of {c}, and each carton sells for ${p}.",
                       f"The eggs go into cartons that hold {c} each. A carton sells for ${p}."])
             + " " + g.pick(["How much money does the farm get for the eggs?",
                             "How many dollars are the eggs worth?"]))
    k = g.op("the cartons are", N, "/", c, "cartons")
    g.op("the money is", k, "*", p, "dollars")
    return q


def t_game_score(g):
    t1, t2 = g.rng.sample(TEAMS, 2)
    sport = g.pick(SPORTS)
    a, b = g.r(5, 60), g.r(5, 60)
    q = (f"In a {sport} game the {t1} score {a} points in the first half and {b} points in the "
         "second half.")
    s = g.op(f"the {t1} score", a, "+", b, "points")
    if g.r(0, 1):
        c = g.r(5, s - 1)
        q += (f" The {t2} score {c} points in the whole game. "
              f"By how many points do the {t1} win?")
        g.op(f"the {t1} win by", s, "-", c, "points")
    else:
        c = g.r(5, 120)
        q += (f" The {t2} score {c} points in all. How many points are scored in the game "
              "altogether?")
        g.op("the game has", s, "+", c, "points")
    return q


def t_practice(g):
    p = g.person()
    what = g.pick([f"practices the {g.pick(INSTRUMENTS)}", "studies", "jogs", "reads",
                   "plays chess", "does yoga", "paints", "practices drawing"])
    m = g.pick([5, 6, 10, 12, 15, 18, 20, 24, 25, 30, 35, 36, 40, 45, 48, 50, 60, 75, 80, 90])
    d = g.r(2, 14)
    q = f"{p.name} {what} for {m} minutes every day."
    if g.r(0, 1):
        d = g.pick([k for k in range(2, 15) if m * k % 60 == 0 and m * k <= MAX_VALUE])
        q += f" How many hours does {p.sub} practice in {d} days?"
        x = g.op(f"in {d} days that is", m, "*", d, "minutes")
        g.op("in hours that is", x, "/", 60, "hours")
    else:
        e = g.r(5, 60)
        q += (f" On the weekend {p.sub} adds {e} extra minutes. How many minutes is that in "
              f"{d} days and the weekend?")
        x = g.op(f"in {d} days that is", m, "*", d, "minutes")
        g.op("with the weekend that is", x, "+", e, "minutes")
    return q


def t_recipe(g):
    p = g.person()
    food = g.pick(BAKED)
    ing, unit = g.pick([("flour", "cups"), ("sugar", "cups"), ("milk", "cups"),
                        ("butter", "sticks"), ("eggs", "eggs"), ("oats", "cups")])
    a, k = g.r(2, 9), g.r(2, 12)
    need = a * k
    h = g.r(1, need - 1)
    of = "" if unit == ing else f" of {ing}"
    q = (f"A recipe for {food} needs {a} {unit}{of} per batch. {p.name} wants to make {k} "
         f"batches and has {h} {unit}{of}. How many more {unit}{of} does {p.sub} need?")
    n = g.op(f"{k} batches need", a, "*", k, unit)
    y = g.op(f"{p.sub} needs", n, "-", h, f"more {unit}")
    if g.r(0, 1):
        pr = g.r(2, 6)
        q = q[: q.rindex(" How many")] + (f" Each {'egg' if unit == 'eggs' else unit[:-1]} "
                                         f"costs ${pr}. How much does {p.sub} spend on the "
                                         f"missing {ing}?")
        g.op("the cost is", y, "*", pr, "dollars")
    return q


def t_fundraiser(g):
    club = g.pick(CLUBS)
    sup = g.pick(SUPPLIES)
    t, pr, e = g.r(10, 99), g.r(2, 9), g.r(10, 200)
    if g.r(0, 1):
        q = (f"The {club} sells {t} tickets for ${pr} each. They spent ${e} on {sup}. "
             f"How much money do they have after paying for the {sup}?")
        x = g.op("the tickets bring in", t, "*", pr, "dollars")
        g.op(f"after the {sup} they have", x, "-", e, "dollars")
    else:
        a, pa, c, pc = g.r(5, 60), g.r(4, 12), g.r(5, 60), g.r(2, 8)
        q = (f"For a show, the {club} sells {a} adult tickets at ${pa} each and {c} child "
             f"tickets at ${pc} each. They spent ${e} on {sup}. How much money is left after "
             f"paying for the {sup}?")
        x = g.op("adult tickets bring", a, "*", pa, "dollars")
        y = g.op("child tickets bring", c, "*", pc, "dollars")
        z = g.op("all tickets bring", x, "+", y, "dollars")
        g.op(f"after the {sup} there is", z, "-", e, "dollars")
    return q


def t_collection(g):
    p, f = g.person(), g.person()
    s, pl = g.pick(ITEMS)
    a, b, m = g.r(5, 90), g.r(2, 20), g.r(2, 12)
    fw, k = g.pick(FRACTIONS)
    a += -(a + b * m) % k  # makes the share exact without favouring small fractions
    q = (f"{p.name} has {a} {pl}. Every month {p.sub} adds {b} more {pl} to {p.pos} collection. "
         f"After {m} months {p.sub} gives {fw} of {p.pos} {pl} to {f.name}. "
         + g.pick([f"How many {pl} does {f.name} get?",
                   f"How many {pl} does {f.name} receive?"]))
    x = g.op(f"in {m} months {p.sub} adds", b, "*", m, pl)
    y = g.op(f"{p.sub} then has", a, "+", x, pl)
    g.op(f"{f.name} gets", y, "/", k, pl)
    return q


def t_laps(g):
    p = g.person()
    where, unit = g.pick([("running track", "meters"), ("pool", "meters"),
                          ("park path", "meters"), ("trail loop", "kilometers")])
    verb = {"pool": "swims"}.get(where, g.pick(["runs", "walks", "jogs"]))
    L = g.r(2, 12) if unit == "kilometers" else g.pick([25, 40, 50, 60, 75, 80, 100, 120])
    d1, d2 = g.rng.sample(WEEKDAYS, 2)
    k, j = g.r(1, 8), g.r(1, 8)
    q = (f"A {where} is {L} {unit} long. {p.name} {verb} {k} lap{'s' if k > 1 else ''} on {d1} "
         f"and {j} lap{'s' if j > 1 else ''} on {d2}. How many {unit} does {p.sub} cover on the "
         "two days?")
    n = g.op(f"{p.sub} does", k, "+", j, "laps")
    g.op("the distance is", n, "*", L, unit)
    return q


def t_party_tables(g):
    p = g.person()
    a, c, k = g.r(4, 60), g.r(2, 60), g.r(2, 10)
    c += -(a + c) % k  # every seat filled: the division is exact
    thing = g.pick([("table", "tables", "seats"), ("van", "vans", "carries"),
                    ("tent", "tents", "sleeps"), ("boat", "boats", "holds")])
    q = (f"{p.name} is planning a trip for {a} adults and {c} children. Each {thing[0]} "
         f"{thing[2]} exactly {k} people, and every {thing[0]} is full. How many {thing[1]} "
         "are needed?")
    t = g.op("there are", a, "+", c, "people")
    g.op(f"the {thing[1]} needed are", t, "/", k, thing[1])
    return q


def t_farm(g):
    an = g.rng.sample(ANIMALS4 + ANIMALS2, 3)
    a, b, k = g.r(3, 60), g.r(2, 40), g.r(2, 6)
    q = (f"A farm has {a} {an[0]}. It has {b} more {an[1]} than {an[0]} and {k} times as many "
         f"{an[2]} as {an[0]}. How many animals are on the farm?")
    x = g.op("there are", a, "+", b, an[1])
    y = g.op("there are", a, "*", k, an[2])
    s = g.op(f"the {an[0]} and {an[1]} make", a, "+", x, "animals")
    g.op("all together there are", s, "+", y, "animals")
    return q


def t_paint(g):
    p = g.person()
    w, c, pr = g.r(2, 9), g.r(2, 6), g.r(5, 30)
    h = g.r(1, w * c - 1)
    what, of = g.pick([("rooms", "cans of paint"), ("fences", "cans of stain"),
                       ("walls", "cans of paint"), ("boats", "cans of varnish")])
    q = (f"{p.name} wants to paint {w} {what}. Each needs {c} {of}, and {p.sub} already has "
         f"{h} cans. One can costs ${pr}. How much does {p.sub} spend on the cans {p.sub} "
         "still needs?")
    n = g.op(f"the {what} need", w, "*", c, "cans")
    x = g.op(f"{p.sub} must buy", n, "-", h, "cans")
    g.op("the cost is", x, "*", pr, "dollars")
    return q


def t_sale(g):
    p = g.person()
    thing = g.pick(GOODS)
    pr, d, k = g.r(5, 90), g.r(2, 30), g.r(2, 9)
    q = (f"{thing.capitalize()} usually cost ${pr} each. During a sale the price drops by ${d}. "
         f"{p.name} buys {k} of them.")
    x = g.op("the sale price is", pr, "-", d, "dollars")
    if g.r(0, 1):
        q += " " + g.pick([f"How much does {p.sub} pay?", f"How much does {p.name} spend?"])
        g.op(f"{p.sub} pays", x, "*", k, "dollars")
    else:
        q += f" How much does {p.sub} save compared with the usual price?"
        full = g.op("at the usual price it would cost", pr, "*", k, "dollars")
        paid = g.op(f"{p.sub} pays", x, "*", k, "dollars")
        g.op(f"{p.sub} saves", full, "-", paid, "dollars")
    return q


def t_shells_jars(g):
    p = g.person()
    s, pl = g.pick(ITEMS)
    cs, cp = g.pick(CONTAINERS)
    a, b, k = g.r(5, 90), g.r(5, 90), g.r(2, 9)
    d1, d2 = g.rng.sample(WEEKDAYS, 2)
    b += -(a + b) % k  # equal shares: the division is exact
    q = (f"{p.name} collects {a} {pl} on {d1} and {b} {pl} on {d2}. {cap(p.sub)} puts them "
         f"equally into {k} {cp}. How many {pl} are in each {cs}?")
    t = g.op(f"{p.sub} collects", a, "+", b, pl)
    g.op(f"each {cs} gets", t, "/", k, pl)
    return q


def t_tickets(g):
    p = g.person()
    place = g.pick(PLACES)
    pa, pc, a, c = g.r(5, 30), g.r(2, 20), g.r(1, 9), g.r(1, 9)
    q = (f"Tickets to the {place} cost ${pa} for adults and ${pc} for children. {p.name} buys "
         f"{a} adult ticket{'s' if a > 1 else ''} and {c} child ticket{'s' if c > 1 else ''}. "
         + g.pick([f"How much does {p.sub} pay?", "How much do the tickets cost in total?"]))
    x = g.op("adult tickets cost", a, "*", pa, "dollars")
    y = g.op("child tickets cost", c, "*", pc, "dollars")
    g.op("in total that is", x, "+", y, "dollars")
    return q


def t_candy_share(g):
    p = g.person()
    s, pl = g.pick(ITEMS)
    k, each = g.r(2, 9), g.r(3, 30)
    a = k * each
    e = g.r(2, each - 1)
    q = (f"{p.name} has a bag of {a} {pl}. {cap(p.sub)} shares them equally among {k} kids. "
         f"Each kid then loses {e} {pl}. How many {pl} does each kid have left?")
    x = g.op("each kid gets", a, "/", k, pl)
    g.op("each kid has", x, "-", e, f"{pl} left")
    return q


def t_aquarium(g):
    fish = g.pick(FISH)
    a, b, k = g.r(5, 80), g.r(2, 40), g.r(2, 6)
    x = a + b
    cs = [c for c in range(1, 30) if c < x and (x - c) % k == 0]
    if not cs:
        raise Reject("fish")
    c = g.pick(cs)
    q = (f"An aquarium has {a} {fish}. The owner adds {b} more, then sells {c} of them. "
         f"The rest are split equally into {k} tanks. How many {fish} are in each tank?")
    x = g.op("after adding there are", a, "+", b, fish)
    y = g.op("after selling there are", x, "-", c, fish)
    g.op("each tank has", y, "/", k, fish)
    return q


def t_trees(g):
    place = g.pick(["park", "orchard", "school yard", "street"])
    tree = g.pick(["oak", "pine", "maple", "apple", "birch", "palm"])
    r, c, d, e = g.r(2, 12), g.r(3, 20), g.r(2, 20), g.r(2, 30)
    q = (f"A {place} has {r} rows of {tree} trees with {c} trees in each row. Workers cut down "
         f"{d} old trees and plant {e} new ones. How many {tree} trees are there now?")
    x = g.op("at first there are", r, "*", c, "trees")
    y = g.op("after cutting there are", x, "-", d, "trees")
    g.op("after planting there are", y, "+", e, "trees")
    return q


def t_factory(g):
    thing = g.pick(["toys", "bottles", "chairs", "shirts", "bricks", "candles", "bolts"])
    m, h, j = g.r(3, 40), g.r(2, 9), g.r(2, 9)
    d1, d2 = g.rng.sample(WEEKDAYS[:5], 2)
    q = (f"A machine makes {m} {thing} every hour. It runs for {h} hours on {d1} and {j} hours "
         f"on {d2}. ")
    if g.r(0, 1):
        q += f"How many {thing} does it make on the two days?"
        x = g.op(f"on {d1} it makes", m, "*", h, thing)
        y = g.op(f"on {d2} it makes", m, "*", j, thing)
        g.op("both days make", x, "+", y, thing)
    else:
        q += f"How many more {thing} does it make on {d1} than on {d2}?"
        if h <= j:
            raise Reject("order")
        x = g.op(f"on {d1} it makes", m, "*", h, thing)
        y = g.op(f"on {d2} it makes", m, "*", j, thing)
        g.op("the difference is", x, "-", y, thing)
    return q


def t_weight(g):
    goods = g.pick(["apples", "books", "tiles", "nails", "rice", "sand", "potatoes"])
    w, n, x = g.r(2, 20), g.r(2, 30), g.r(5, 200)
    unit = g.pick(["kilograms", "pounds"])
    q = (f"A box of {goods} weighs {w} {unit}. A truck carries {n} boxes and a crate that "
         f"weighs {x} {unit}. How many {unit} does the truck carry in all?")
    b = g.op("the boxes weigh", n, "*", w, unit)
    g.op("with the crate that is", b, "+", x, unit)
    return q


def t_budget(g):
    p = g.person()
    t1, t2 = g.rng.sample(PURCHASES, 2)
    job = g.pick(JOBS)
    a, b, c, d = g.r(40, 300), g.r(2, 60), g.r(2, 60), g.r(5, 80)
    q = (f"{p.name} has ${a}. {cap(p.sub)} spends ${b} on a {t1} and ${c} on a {t2}. "
         f"Then {p.sub} earns ${d} {job}. How much money does {p.sub} have now?")
    x = g.op(f"after the {t1} {p.sub} has", a, "-", b, "dollars")
    y = g.op(f"after the {t2} {p.sub} has", x, "-", c, "dollars")
    g.op(f"after {job} {p.sub} has", y, "+", d, "dollars")
    return q


def t_split_bill(g):
    thing = g.pick(["dinner", "taxi ride", "cabin", "gift", "boat trip", "pizza order",
                    "concert trip", "birthday cake", "camping site", "bowling night", "hotel room"])
    fee = g.pick(["fee", "tip", "delivery fee", "booking fee", "service charge", "parking fee"])
    who = g.pick(["friends", "cousins", "classmates", "coworkers", "teammates", "neighbors"])
    k, each = g.r(2, 9), g.r(4, 99)
    tot = k * each
    if tot > MAX_VALUE:
        raise Reject("bill")
    t = g.r(2, min(60, tot - 2))
    pr = tot - t
    q = (f"{k} {who} share the cost of a {thing} that costs ${pr}. They also pay a ${t} "
         f"{fee}. " + g.pick(["If they split everything equally, how much does each one pay?",
                              "They split the total evenly. What is each person's share?"]))
    s = g.op("the total is", pr, "+", t, "dollars")
    g.op("each one pays", s, "/", k, "dollars")
    return q


def t_rectangle(g):
    field = g.pick(FIELDS + ["lawn", "courtyard", "pasture", "tennis court", "room floor"])
    owner = g.pick(["A", f"{g.person().name}'s", "The school's", "The town's", "A neighbor's"])
    unit = g.pick(["meters", "feet", "yards"])
    l, w = g.r(3, 60), g.r(2, 40)
    if g.r(0, 1):
        q = (f"{owner} rectangular {field} is {l} {unit} long and {w} {unit} wide. "
             + g.pick([f"How many {unit} of fence are needed to go all the way around it?",
                       f"What is the distance around it in {unit}?",
                       f"How many {unit} of rope go once around its edge?"]))
        h = g.op("one length and one width make", l, "+", w, unit)
        g.op("all the way around is", h, "*", 2, unit)
    else:
        k = g.r(2, 80)
        cover = g.pick(["a shed", "a pond", "a sandbox", "a carpet", "a stage", "flower beds"])
        q = (f"{owner} rectangular {field} is {l} {unit} long and {w} {unit} wide. {k} square "
             f"{unit} of it are covered by {cover}. How many square {unit} are not covered?")
        a = g.op("the area is", l, "*", w, f"square {unit}")
        g.op("the open part is", a, "-", k, f"square {unit}")
    return q


def t_weeks(g):
    p = g.person()
    act, base, unit = g.pick([("swims", "swim", "laps"), ("does", "do", "push-ups"),
                              ("reads", "read", "pages"), ("writes", "write", "lines of a poem"),
                              ("walks", "walk", "blocks"), ("ties", "tie", "knots"),
                              ("folds", "fold", "paper cranes"), ("learns", "learn", "new words"),
                              ("bakes", "bake", "rolls"), ("draws", "draw", "sketches")])
    n, w = g.r(2, 40), g.r(2, 5)
    if g.r(0, 1):
        q = (f"{p.name} {act} {n} {unit} every day. How many {unit} does {p.sub} {base} in {w} "
             "weeks?")
        d = g.op(f"{w} weeks have", w, "*", 7, "days")
    else:
        e = g.r(2, 6)
        q = (f"Every day for {w} weeks and {e} more days, {p.name} {act} {n} {unit}. "
             f"How many {unit} does {p.sub} {base} in that time?")
        d = g.op(f"{w} weeks have", w, "*", 7, "days")
        d = g.op("with the extra days that is", d, "+", e, "days")
    g.op(f"{p.sub} {act}", n, "*", d, unit)
    return q

TEMPLATES = [t_buy_bags_give, t_shop_cost, t_savings, t_ages, t_distance, t_bake_share,
             t_classroom, t_garden, t_reading, t_fruit_days, t_job, t_legs, t_pizza, t_give_each,
             t_bus, t_library, t_compare3, t_tank, t_eggs, t_game_score, t_practice, t_recipe,
             t_fundraiser, t_collection, t_laps, t_party_tables, t_farm, t_paint, t_sale,
             t_shells_jars, t_tickets, t_candy_share, t_aquarium, t_trees, t_factory, t_weight,
             t_budget, t_split_bill, t_rectangle, t_weeks]


# ------------------------------------------------------------------------------------------------
# Problems, splits and the text format

def _one_problem(rng):
    """Draws templates until one satisfies every constraint."""
    for _ in range(1000):
        tmpl = rng.choice(TEMPLATES)
        g = Gen(rng)
        try:
            q = tmpl(g)
        except Reject:
            continue
        if not 2 <= len(g.steps) <= 4:
            raise AssertionError(f"{tmpl.__name__} made {len(g.steps)} steps")
        return {"question": q, "solution": " ".join(g.steps), "answer": g.last,
                "template": tmpl.__name__}
    raise RuntimeError("no template satisfied its constraints in 1000 draws")


def normalize(question):
    return " ".join(question.lower().split())


def _public(p):
    return {"question": p["question"], "solution": p["solution"], "answer": p["answer"]}


def _draw(rng, n, exclude, keep_template=False):
    out, seen = [], set()
    for _ in range(50 * n + 1000):
        if len(out) == n:
            break
        p = _one_problem(rng)
        key = normalize(p["question"])
        if key in seen or key in exclude:
            continue  # unique within a split, and train never repeats a test question
        seen.add(key)
        out.append(p if keep_template else _public(p))
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} distinct problems after many draws")
    return out


_TEST_CACHE = None
_TEST_Q = None


def _test_full():
    global _TEST_CACHE
    if _TEST_CACHE is None:
        # str seeds hash with SHA-512 inside random, so this is stable across runs and versions
        _TEST_CACHE = _draw(random.Random(f"test:{TEST_SEED}"), TEST_SIZE, frozenset(),
                            keep_template=True)
    return _TEST_CACHE


TEST_JSONL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gsm_test.jsonl")


def test_questions():
    """Normalised question strings of the test split (what train must never contain): the
    generated split plus the committed gsm_test.jsonl, so that train stays clean of the file the
    eval reads even if the templates change after it was written."""
    qs = {normalize(p["question"]) for p in _test_full()}
    if os.path.exists(TEST_JSONL):
        with open(TEST_JSONL) as f:
            qs.update(normalize(json.loads(line)["question"]) for line in f if line.strip())
    return frozenset(qs)


def make_problems(split, n, seed, with_template=False):
    """n problems of split "train" or "test" as dicts {question, solution, answer}.

    "test" is always the same 1,319 problems (seed is ignored; n <= 1319 gives the first n).
    "train" is deterministic in seed and never contains a test question."""
    if split == "test":
        if n > TEST_SIZE:
            raise ValueError(f"the test split has {TEST_SIZE} problems, asked for {n}")
        full = _test_full()[:n]
        return [dict(p) if with_template else _public(p) for p in full]
    if split == "train":
        global _TEST_Q
        if _TEST_Q is None:
            _TEST_Q = test_questions()
        return _draw(random.Random(f"train:{seed}"), n, _TEST_Q, with_template)
    raise ValueError(f"unknown split {split!r} (train or test)")


def format_example(p):
    return ("Question: " + p["question"] + "\nAnswer: " + p["solution"] + "\n#### "
            + str(p["answer"]))


def few_shot_prompt(question, shots):
    """The prompt for one question: the shots (problem dicts or formatted strings) then the
    question, ending in "Answer:" so the model continues with " <solution>"."""
    head = "\n\n".join(s if isinstance(s, str) else format_example(s) for s in shots)
    tail = "Question: " + question + "\nAnswer:"
    return head + "\n\n" + tail if head else tail


_FEWSHOT = None


def fewshot_examples():
    """The fixed 4 shots (train split, FEWSHOT_SEED) used by gsm_eval.py and the lm-eval task."""
    global _FEWSHOT
    if _FEWSHOT is None:
        _FEWSHOT = make_problems("train", 4, FEWSHOT_SEED)
    return [dict(p) for p in _FEWSHOT]


# ------------------------------------------------------------------------------------------------
# Self-check: recompute every answer from the solution's own equations

_EQ = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")
_NUM = re.compile(r"\d+")
# Numbers a step may use without them appearing in the question: "twice", "half", "a quarter",
# legs and wheels, days in a week, minutes in an hour, "the person too" (+ 1).
_IMPLICIT = {1, 2, 3, 4, 5, 7, 60}


def check_problem(p):
    """Raises AssertionError unless the solution's equations are all right, the last result is the
    answer, there are 2..4 of them, every operand comes from the question or an earlier step, and
    every number is a non-negative integer below 1000."""
    q, sol, ans = p["question"], p["solution"], p["answer"]
    assert isinstance(ans, int) and 0 <= ans <= MAX_VALUE, p
    assert "\n" not in q and "\n" not in sol, p
    sentences = [s for s in sol.split(". ") if s]
    eqs = _EQ.findall(sol)
    assert 2 <= len(eqs) <= 4 and len(eqs) == len(sentences), p
    known = {int(x) for x in _NUM.findall(q)} | _IMPLICIT
    for a, op, b, c in eqs:
        a, b, c = int(a), int(b), int(c)
        want = {"+": a + b, "-": a - b, "*": a * b}.get(op)
        if op == "/":
            assert b and a % b == 0, p
            want = a // b
        assert want == c, f"{a} {op} {b} != {c} in {p}"
        assert a in known and b in known, f"operand of {a} {op} {b} not known in {p}"
        known.add(c)
    assert int(eqs[-1][3]) == ans, p
    for x in _NUM.findall(q + " " + sol):
        assert int(x) <= MAX_VALUE, p
    assert sol.endswith("."), p


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--split", choices=["train", "test"], default="train")
    ap.add_argument("--n", type=int, default=None, help="problems (default: 1319 test, 5 train)")
    ap.add_argument("--seed", type=int, default=0, help="train split seed")
    ap.add_argument("--out", help="write JSON lines {question, solution, answer} here")
    ap.add_argument("--fewshot-out", help="write the 4 few-shot examples as JSON lines here")
    ap.add_argument("--self-check", type=int, metavar="N",
                    help="check the test split and N train problems, print template stats")
    a = ap.parse_args(argv)
    if a.fewshot_out:
        with open(a.fewshot_out, "w") as f:
            for p in fewshot_examples():
                f.write(json.dumps(p) + "\n")
        return 0
    if a.self_check is not None:
        test = make_problems("test", TEST_SIZE, 0, with_template=True)
        train = make_problems("train", a.self_check, a.seed, with_template=True)
        tq = test_questions()
        for p in test + train:
            check_problem(p)
        assert not any(normalize(p["question"]) in tq for p in train)
        counts = {}
        for p in train:
            counts[p["template"]] = counts.get(p["template"], 0) + 1
        steps = [len(_EQ.findall(p["solution"])) for p in train]
        print(f"ok: {len(test)} test + {len(train)} train problems checked, "
              f"{len(TEMPLATES)} templates, {len(counts)} used; steps 2/3/4: "
              + "/".join(str(steps.count(k)) for k in (2, 3, 4)))
        return 0
    n = a.n if a.n is not None else (TEST_SIZE if a.split == "test" else 5)
    probs = make_problems(a.split, n, a.seed)
    if a.out:
        with open(a.out, "w") as f:
            for p in probs:
                f.write(json.dumps(p) + "\n")
        print(f"wrote {len(probs)} {a.split} problems to {a.out}")
    else:
        print("\n\n".join(format_example(p) for p in probs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Training data for the bundled model, second generation (issue 37): word problems in varied
language, arithmetic practice and K3 chat conversations.

Why a new generator: tools/data/gsm.py has 40 fixed templates of 2-4 steps with every number
below 1000, and a model trained on it learned the templates, not the task (it fails "she" for
"Mia", results outside 0..999, and a chat "Hello!").  Here each problem is built from *families*
whose facts and questions each have many phrasings, with names and pronouns mixed, independent
facts shuffled, distractor sentences, 1 to 8 steps, units, percentages, rates, averages, working
backwards, "how many more / fewer", remainders, negative, decimal and four-to-six-digit results.

The held-out evaluation set lives under eval/, is written separately and is never imported here.

Text format (the same as gsm.py, so gsm_eval.py and few-shot prompts read both):
    "Question: " + q + "\\nAnswer: " + working + "\\n#### " + answer
The working is one short step per line ("She buys 3 * 12 = 36 apples."); a product of two numbers
of two or more digits is written out by place value ("34 * 27 = 34 * 20 + 34 * 7 = 680 + 238 =
918"), a quotient of two or more digits by a split of the dividend, so that a small model emits
one digit-sized operation at a time.  Answers may be negative or decimal ("#### -7", "#### 2.5").

Chat conversations (make_stream_items) are lists of OpenAI-style messages that the trainer renders
with tools/train/chat_k3.py exactly as the server does; thinking mode puts the working in the
think channel and a one-line answer ending in "#### N" in the response; non-thinking mode puts the
working in the response.

CLI:
    python3 tools/data/gsm2.py --n 5 --seed 1           (prints formatted examples)
    python3 tools/data/gsm2.py --self-check 20000       (verifies every equation of N problems)
    python3 tools/data/gsm2.py --chat 3                 (prints chat items)
"""
import argparse
import json
import os
import random
import re
import sys
from fractions import Fraction

FEWSHOT_SEED = 37_0404
HELDOUT_SEED = 37_1319  # the in-distribution tier of the held-out eval draws from this seed

# ------------------------------------------------------------------------------------------------
# Word pools.  Names carry their pronouns.

_F = ["Mia", "Emma", "Olivia", "Ava", "Sofia", "Lily", "Chloe", "Grace", "Zoe", "Nora", "Hannah",
      "Ella", "Ruby", "Alice", "Maya", "Leah", "Sara", "Julia", "Rosa", "Anna", "Priya", "Aisha",
      "Mei", "Fatima", "Elena", "Nina", "Ivy", "Lucy", "Clara", "Jade", "Amara", "Hana", "Isla",
      "Tara", "Vera", "Wendy", "Beatriz", "Yuki", "Ingrid", "Keisha", "Lena", "Marta", "Noor",
      "Paula", "Rita", "Sana", "Tess", "Uma", "Zara", "Carmen", "Dana", "Eva", "Gina", "Helen",
      "Irene", "Joy", "Kim", "Laura", "Molly", "Nadia", "Ola", "Pia", "Rachel", "Sue"]
_M = ["Leo", "Noah", "Liam", "Ethan", "Lucas", "Mason", "Owen", "Jack", "Ben", "Sam", "Max",
      "Omar", "Ravi", "Kenji", "Diego", "Tom", "Adam", "Eli", "Hugo", "Felix", "Oscar", "Marco",
      "Jamal", "Ali", "Theo", "Finn", "Caleb", "Luis", "Ivan", "Yusuf", "Arjun", "Kofi", "Pablo",
      "Victor", "Henry", "Carlos", "Andre", "Bruno", "Chen", "Dev", "Emil", "Farid", "Gabe",
      "Hassan", "Igor", "Jonas", "Karl", "Lars", "Malik", "Nico", "Otto", "Pedro", "Raj", "Seth",
      "Tariq", "Umar", "Vik", "Wes", "Xavier", "Yosef", "Zane", "Dmitri", "Ezra", "Jin"]

ITEMS = [("apple", "apples"), ("orange", "oranges"), ("pear", "pears"), ("lemon", "lemons"),
         ("marble", "marbles"), ("sticker", "stickers"), ("pencil", "pencils"),
         ("crayon", "crayons"), ("marker", "markers"), ("eraser", "erasers"),
         ("trading card", "trading cards"), ("stamp", "stamps"), ("shell", "shells"),
         ("bead", "beads"), ("button", "buttons"), ("coin", "coins"), ("balloon", "balloons"),
         ("cookie", "cookies"), ("cupcake", "cupcakes"), ("toy car", "toy cars"),
         ("comic book", "comic books"), ("rock", "rocks"), ("candle", "candles"),
         ("ribbon", "ribbons"), ("postcard", "postcards"), ("paper clip", "paper clips"),
         ("plum", "plums"), ("peach", "peaches"), ("candy", "candies"), ("badge", "badges"),
         ("egg", "eggs"), ("book", "books"), ("flower", "flowers"), ("nail", "nails"),
         ("brick", "bricks"), ("ticket", "tickets"), ("card", "cards"), ("potato", "potatoes")]
CONTAINERS = [("bag", "bags"), ("box", "boxes"), ("pack", "packs"), ("jar", "jars"),
              ("basket", "baskets"), ("crate", "crates"), ("bundle", "bundles"), ("tin", "tins"),
              ("carton", "cartons"), ("bucket", "buckets"), ("tray", "trays"), ("case", "cases")]
GOODS = [("notebook", "notebooks"), ("pen", "pens"), ("sandwich", "sandwiches"),
         ("bottle of juice", "bottles of juice"), ("cup of coffee", "cups of coffee"),
         ("ruler", "rulers"), ("bag of chips", "bags of chips"), ("banana", "bananas"),
         ("hat", "hats"), ("pair of socks", "pairs of socks"), ("mug", "mugs"),
         ("T-shirt", "T-shirts"), ("plate", "plates"), ("towel", "towels"), ("lamp", "lamps"),
         ("chair", "chairs"), ("kite", "kites"), ("ball", "balls"), ("puzzle", "puzzles")]
DISTRACTORS = [
    "It is a sunny {day}.", "{o} has {n} cousins.", "The shop opened {n} years ago.",
    "{o} is {n} years old.", "The bus ride takes {n} minutes.", "{o} likes the color blue.",
    "The street has {n} houses.", "It rained on {day}.", "{o} walked {n} blocks to school.",
    "The store has {n} workers.", "{o} has a dog named Pepper.", "The park is {n} miles away.",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
UNITS_TIME = [("hour", "hours", 60, "minutes"), ("minute", "minutes", 60, "seconds"),
              ("day", "days", 24, "hours"), ("week", "weeks", 7, "days")]
UNITS_LEN = [("meter", "meters", 100, "centimeters"), ("kilometer", "kilometers", 1000, "meters"),
             ("foot", "feet", 12, "inches"), ("kilogram", "kilograms", 1000, "grams"),
             ("liter", "liters", 1000, "milliliters"), ("dozen", "dozen", 12, "items")]


class Reject(Exception):
    """A drawn problem broke a constraint; draw again."""


class Person:
    def __init__(self, name, female):
        self.name, self.female = name, female
        self.sub = "she" if female else "he"
        self.obj = "her" if female else "him"
        self.pos = "her" if female else "his"


def cap(s):
    return s[:1].upper() + s[1:]


def fmt(x):
    """Exact number -> text: integers plainly, terminating decimals with at most 2 places."""
    x = Fraction(x)
    if x.denominator == 1:
        return str(x.numerator)
    if (x * 100).denominator != 1:
        raise Reject("decimal with more than 2 places")
    s = f"{float(x):.2f}".rstrip("0").rstrip(".")
    return s


def money(x):
    return ("-$" if x < 0 else "$") + fmt(abs(x))


# ------------------------------------------------------------------------------------------------
# Worked arithmetic: one line per step; long products and quotients written out by place value.

def _prod_expr(a, b):
    """`a * b = ...` with the larger factor split by place value when both have 2+ digits."""
    c = a * b
    if isinstance(a, int) and isinstance(b, int) and abs(a) >= 10 and abs(b) >= 10 and a >= 0 and b >= 0:
        big, small = (a, b) if a >= b else (b, a)
        parts = []
        s = str(small)
        for i, d in enumerate(s):
            v = int(d) * 10 ** (len(s) - 1 - i)
            if v:
                parts.append(v)
        if len(parts) > 1:
            terms = " + ".join(f"{big} * {v}" for v in parts)
            vals = " + ".join(str(big * v) for v in parts)
            return f"{a} * {b} = {terms} = {vals} = {c}"
    return f"{fmt(a)} * {fmt(b)} = {fmt(c)}"


def _div_expr(a, b):
    q = Fraction(a) / Fraction(b)
    if (isinstance(a, int) and isinstance(b, int) and b > 1 and q.denominator == 1 and q >= 20
            and a > 0):
        qi = int(q)
        if qi >= 1000:  # long quotients: one part per nonzero digit, each a digit times b
            parts = [int(d) * 10 ** (len(str(qi)) - 1 - i) for i, d in enumerate(str(qi)) if d != "0"]
            if len(parts) > 1:
                return (f"{a} / {b} = ({' + '.join(str(b * v) for v in parts)}) / {b} = "
                        f"{' + '.join(map(str, parts))} = {qi}")
        k = len(str(qi)) - 1
        hi = (qi // 10 ** k) * 10 ** k
        lo = qi - hi
        if lo:
            return f"{a} / {b} = ({b * hi} + {b * lo}) / {b} = {hi} + {lo} = {qi}"
    return f"{fmt(a)} / {fmt(b)} = {fmt(q)}"


def expr(a, op, b):
    """(text, value) of one binary operation."""
    a, b = Fraction(a), Fraction(b)
    ai = int(a) if a.denominator == 1 else a
    bi = int(b) if b.denominator == 1 else b
    if op == "+":
        return f"{fmt(a)} + {fmt(b)} = {fmt(a + b)}", a + b
    if op == "-":
        return f"{fmt(a)} - {fmt(b)} = {fmt(a - b)}", a - b
    if op == "*":
        return _prod_expr(ai, bi), a * b
    if op == "/":
        if b == 0:
            raise Reject("division by zero")
        return _div_expr(ai, bi), a / b
    raise ValueError(op)


class Gen:
    """Random helpers for one problem, plus the working being built."""

    def __init__(self, rng, big=False):
        self.rng = rng
        self.steps = []
        self.used = set()
        self.big = big  # numbers a size larger (still within what the model must learn)

    def r(self, lo, hi):
        if self.big:
            hi = hi * self.pick([2, 5, 10])
        return self.rng.randint(lo, hi)

    def ri(self, lo, hi):  # never scaled
        return self.rng.randint(lo, hi)

    def pick(self, seq):
        return self.rng.choice(seq)

    def chance(self, p):
        return self.rng.random() < p

    def person(self):
        for _ in range(100):
            female = self.rng.random() < 0.5
            name = self.pick(_F if female else _M)
            if name not in self.used:
                self.used.add(name)
                return Person(name, female)
        raise Reject("names")

    def ref(self, p, first=False):
        """Name or pronoun: later mentions use the pronoun half of the time."""
        return p.name if first or self.chance(0.5) else p.sub

    def op(self, clause, a, sym, b, unit="", money_=False):
        text, c = expr(a, sym, b)
        if money_ and sym in "+-":
            text = re.sub(r"(?<![\d.])(-?)(\d+(?:\.\d+)?)", r"\1$\2", text)
        elif money_:
            unit = "dollars"
        tail = " " + unit if unit else ""
        self.steps.append(f"{cap(clause)} {text}{tail}.")
        return c

    def say(self, line):
        self.steps.append(line)

    def distractor(self):
        o = self.person()
        return self.pick(DISTRACTORS).format(o=o.name, n=self.ri(2, 40), day=self.pick(DAYS))


def _join(g, facts, question, shuffle=True, distract=0.3):
    """Facts (list of sentences; those in a tuple keep their order) + optional distractor."""
    facts = list(facts)
    if g.chance(distract):
        facts.insert(g.ri(0, len(facts)), g.distractor())
    return " ".join(facts + [question])


# ------------------------------------------------------------------------------------------------
# Families.  Each takes a Gen and returns the question; the working is in g.steps and the answer
# is returned as the second value.

# Phrasing pools shared by the families (issue 37's second data pass: the m20 model learned the
# first pass's phrasings and failed the same facts in other words, so every fact and question
# below has many wordings, written from everyday English).
HAS = ["has", "owns", "keeps", "possesses", "holds", "has got"]


def ask_count(g, p, pl, when=None):
    """A question asking how many `pl` person p has after the story (many wordings)."""
    w = when or g.pick(["now", "in the end", "at the end", "after all this", "now", "at the end of the day"])
    n, s = p.name, p.sub
    who = n if g.chance(0.75) else s
    has = "has"
    return g.pick([
        f"How many {pl} does {who} have {w}?",
        f"How many {pl} does {who} have {w}?",
        f"How many {pl} does {who} end up with?",
        f"How many {pl} are left with {n}?",
        f"What is the number of {pl} {n} {has} {w}?",
        f"Find how many {pl} {n} {has} {w}.",
        f"Find the number of {pl} that {who} {has} {w}.",
        f"Determine how many {pl} {who} {has} {w}.",
        f"What total number of {pl} does {who} have {w}?",
        f"What is the total number of {pl} {n} {has} {w}?",
        f"Work out how many {pl} {n} {has} {w}.",
        f"Calculate how many {pl} {who} {has} {w}.",
        f"How many {pl} does {n} own {w}?",
        f"{n} now has how many {pl}?",
        f"After all of that, how many {pl} does {who} have?",
        f"How many {pl} are in {n}'s collection {w}?",
        f"Count {n}'s {pl} {w}. How many are there?",
        f"How many {pl} does {who} keep in the end?",
        f"What number of {pl} does {n} end up with?",
        f"By the end, how many {pl} does {n} have?",
    ])


def f_inventory(g):
    """A person's count changes through 1-8 events (buy packs, give, get, lose, double, share)."""
    p = g.person()
    s, pl = g.pick(ITEMS)
    x = g.r(3, 80)
    cs0 = g.pick(CONTAINERS)[0]
    q = [g.pick([f"{p.name} has {x} {pl}.", f"{p.name} owns {x} {pl}.", f"{p.name} {g.pick(HAS)} {x} {pl}.",
                 f"{p.name} starts with {x} {pl}.", f"At first, {p.name} has {x} {pl}.",
                 f"There are {x} {pl} in {p.name}'s collection.", f"{p.name} begins with {x} {pl}.",
                 f"{p.name} had {x} {pl} in the morning.", f"{p.name} has a collection of {x} {pl}.",
                 f"{p.name}'s {cs0} contains {x} {pl}.", f"In {p.pos} room, {p.name} keeps {x} {pl}.",
                 f"{p.name} has saved up {x} {pl}.", f"To start, {p.name} has {x} {pl}.",
                 f"{p.name} counts {x} {pl} in {p.pos} {cs0}."])]
    n_events = g.pick([1, 1, 2, 2, 3, 3, 4, 5, 6, 7])
    cur = Fraction(x)
    who = p.name
    for _ in range(n_events):
        kind = g.pick(["buy", "give", "get", "lose", "packs", "double", "share", "eat", "sell"])
        f = None
        if kind in ("give", "lose", "eat", "sell"):
            d = g.r(1, 40)
            if d > cur:
                kind = "get"
        if kind == "buy" or kind == "get":
            d = g.r(1, 50)
            P, r = cap(g.ref(p)), g.ref(p)
            if kind == "buy":
                q.append(g.pick([f"{P} buys {d} more {pl}.", f"Then {r} buys another {d} {pl}.",
                                 f"{P} picks up {d} {pl} at the market.", f"{P} purchases {d} more {pl}.",
                                 f"Next, {r} orders {d} {pl} online.", f"{P} adds {d} new {pl} to the pile.",
                                 f"{P} gets {d} more {pl} at the store.", f"After that, {r} buys {d} {pl}."]))
            else:
                f = g.person()
                q.append(g.pick([f"{f.name} gives {p.obj} {d} {pl}.", f"{P} gets {d} {pl} from {f.name}.",
                                 f"{P} receives {d} more {pl} as a gift.", f"{f.name} hands {p.obj} {d} {pl}.",
                                 f"{f.name} donates {d} {pl} to {p.name}.", f"{P} is given {d} {pl} by {f.name}.",
                                 f"{f.name} sends {p.obj} {d} {pl}.", f"{P} collects {d} more {pl}.",
                                 f"{P} wins {d} {pl} in a game.", f"{P} finds {d} {pl} in the garage.",
                                 f"{f.name} passes {d} {pl} to {p.obj}."]))
            cur = g.op(g.pick([f"{who} now has", "Then there are", "That makes", f"{cap(p.sub)} has"]), cur, "+", d,
                       pl)
        elif kind == "give":
            f = g.person()
            P = cap(g.ref(p))
            q.append(g.pick([f"{P} gives {d} {pl} to {f.name}.", f"{P} gives {f.name} {d} of them.",
                             f"{f.name} takes {d} {pl} from {p.obj}.", f"{P} hands {d} {pl} to {f.name}.",
                             f"{P} donates {d} {pl} to a school.", f"{P} trades away {d} {pl}.",
                             f"{P} gives away {d} {pl}.", f"{P} passes {d} of the {pl} to {f.name}.",
                             f"{P} sends {d} {pl} to {f.name}.", f"{f.name} receives {d} {pl} from {p.obj}."]))
            cur = g.op(g.pick([f"After giving some away, {p.sub} has", "Then there are", "That leaves",
                               f"{who} is left with"]), cur, "-", d, pl)
        elif kind in ("lose", "eat", "sell"):
            edible = s in ("apple", "orange", "pear", "cookie", "cupcake", "plum", "peach", "candy")
            P, r = cap(g.ref(p)), g.ref(p)
            if kind == "sell":
                opts = [f"{P} sells {d} {pl}.", f"{P} sells {d} of the {pl} at a yard sale."]
            elif kind == "eat" and edible:
                opts = [f"{P} eats {d} {pl}.", f"Later, {r} eats {d} of the {pl}.", f"{P} eats {d} of them."]
            else:
                opts = [f"{P} loses {d} {pl}.", f"Later, {r} loses {d} of the {pl}.", f"{P} drops {d} {pl}.",
                        f"{d} of the {pl} go missing.", f"{P} misplaces {d} {pl}.",
                        f"Sadly, {d} {pl} get lost."]
            q.append(g.pick(opts))
            cur = g.op(g.pick(["That leaves", f"{cap(p.sub)} then has", "Now there are", "What remains is"]), cur, "-",
                       d, pl)
        elif kind == "packs":
            cs, cp = g.pick(CONTAINERS)
            k, m = g.ri(2, 12), g.r(2, 30)
            P, r = cap(g.ref(p)), g.ref(p)
            q.append(g.pick([f"{P} buys {k} {cp} with {m} {pl} in each {cs}.",
                             f"{P} buys {k} {cp} of {pl}, and each {cs} holds {m} {pl}.",
                             f"Then {r} gets {k} {cp} of {m} {pl} each.",
                             f"{P} buys {k} {cp} of {pl}. Each {cs} has {m} {pl}.",
                             f"{P} purchases {k} {cp}; every {cs} contains {m} {pl}.",
                             f"{P} gets {k} {cp}, each holding {m} {pl}.",
                             f"{P} opens {k} new {cp} of {m} {pl} each.",
                             f"A {cs} holds {m} {pl}, and {r} buys {k} {cp}."]))
            n = g.op(f"The {cp} hold", k, "*", m, pl)
            cur = g.op(g.pick([f"{who} now has", "Together that is", "That makes"]), cur, "+", n, pl)
        elif kind == "double":
            if cur > 2000:
                raise Reject("big")
            P = cap(g.ref(p))
            q.append(g.pick([f"{P} doubles the number of {pl}.", f"The number of {pl} {p.sub} has then doubles.",
                             f"{P} ends up with twice as many {pl} as before.",
                             f"Then the number of {pl} grows to twice as many."]))
            cur = g.op("Doubling gives", cur, "*", 2, pl)
        elif kind == "share":
            k = g.pick([2, 3, 4, 5])
            if cur % k:
                raise Reject("share")
            P = cap(g.ref(p))
            q.append(g.pick([f"{P} splits the {pl} equally into {k} piles and keeps one pile.",
                             f"{P} gives away all but one of {k} equal parts of the {pl}.",
                             f"{P} divides the {pl} into {k} equal groups and keeps only one group."]))
            cur = g.op("One part is", cur, "/", k, pl)
    question = ask_count(g, p, pl)
    facts = q
    if g.chance(0.25):
        facts = facts + [g.distractor()]
    if g.chance(0.12):  # the question first, then the story
        lead = g.pick([f"How many {pl} does {p.name} have after the following?",
                       f"Find the number of {pl} {p.name} ends up with.",
                       f"Work out how many {pl} {p.name} has at the end of this story."])
        return " ".join([lead] + facts), cur
    return " ".join(facts + [question]), cur


def f_shopping(g):
    p = g.person()
    n_goods = g.pick([1, 2, 2, 3])
    goods = g.rng.sample(GOODS, n_goods)
    facts, totals = [], []
    for s, pl in goods:
        k, c = g.ri(2, 12), g.r(2, 40)
        if g.chance(0.2):
            c = Fraction(g.ri(2, 40) * 4 + g.pick([1, 2, 3]), 4)  # $x.25 / .5 / .75
        facts.append(g.pick([f"{p.name} buys {k} {pl} for {money(c)} each.",
                             f"{cap(pl)} cost {money(c)} each, and {p.name} buys {k}.",
                             f"{p.name} gets {k} {pl} at {money(c)} apiece.",
                             f"Each {s} costs {money(c)}; {p.name} takes {k} of them.",
                             f"{p.name} pays {money(c)} for each of {k} {pl}.",
                             f"{p.name} orders {k} {pl} that sell for {money(c)} apiece.",
                             f"The price of one {s} is {money(c)}, and {p.name} buys {k}.",
                             f"{p.name} picks out {k} {pl} priced at {money(c)} each.",
                             f"{p.name} spends {money(c)} on each of the {k} {pl} {p.sub} buys."]))
        totals.append(g.op(f"The {pl} cost", k, "*", c, money_=True))
    total = totals[0]
    for t in totals[1:]:
        total = g.op("Together that is", total, "+", t, money_=True)
    mode = g.pick(["total", "change", "discount", "left"])
    if mode == "change":
        bill = g.pick([20, 50, 100, 200, 500])
        if bill < total:
            raise Reject("bill")
        qq = g.pick([f"{cap(p.sub)} pays with a ${bill} bill. How much change does {p.sub} get?",
                     f"If {p.sub} hands over ${bill}, how much change should {p.sub} receive?",
                     f"{cap(p.sub)} pays with ${bill}. How many dollars of change come back?",
                     f"{p.name} gives the cashier ${bill}. How much change is due?",
                     f"Paying with a ${bill} bill, what change does {p.name} get back?",
                     f"{cap(p.sub)} hands the clerk ${bill}. Find the change."])
        ans = g.op("The change is", bill, "-", total, money_=True)
    elif mode == "discount":
        pct = g.pick([10, 20, 25, 50, 5, 15, 30])
        qq = g.pick([f"The store gives {p.obj} a {pct}% discount on the whole bill. How much does {p.sub} pay?",
                     f"With a {pct}% discount, what does {p.name} pay in total?",
                     f"Everything is {pct}% off today. How much does {p.name} pay?",
                     f"{p.name} uses a coupon for {pct}% off the total. What is the final price?",
                     f"There is a {pct}% sale on the whole order. Find the amount {p.name} pays."])
        off = g.op(f"The discount is {pct}% of {money(total)}:", total, "*", Fraction(pct, 100), money_=True)
        ans = g.op("So the bill is", total, "-", off, money_=True)
    elif mode == "left":
        w = g.r(50, 500)
        if w < total:
            raise Reject("wallet")
        facts.insert(0, f"{p.name} has {money(w)}.")
        facts[0] = g.pick([f"{p.name} has {money(w)}.", f"{p.name} has {money(w)} in {p.pos} wallet.",
                           f"{p.name} brings {money(w)} to the store.", f"{p.name} starts with {money(w)} to spend."])
        qq = g.pick([f"How much money does {p.name} have left?", f"How many dollars are left after shopping?",
                     f"How much money remains?", f"What amount of money is left?",
                     f"How many dollars does {p.name} still have?", f"Find how much money {p.name} has left."])
        ans = g.op("Left over:", w, "-", total, money_=True)
    else:
        qq = g.pick([f"How much does {p.name} spend in total?", f"How many dollars does {p.sub} pay altogether?",
                     f"What is the total cost?", f"What is the total bill?", f"How much money does {p.name} spend?",
                     f"Find the total amount {p.name} pays.", f"What total does {p.name} pay at the register?",
                     f"How much does everything cost together?", f"Determine the cost of the whole order."])
        ans = total
    if g.chance(0.5):
        g.rng.shuffle(facts)
    return _join(g, facts, qq), ans


def f_percent(g):
    p = g.person()
    mode = g.pick(["of", "increase", "decrease", "what_pct", "remaining"])
    if mode == "of":
        pct, n = g.pick([10, 20, 25, 30, 40, 50, 60, 75, 5, 15, 12]), g.r(4, 200) * 5
        s, pl = g.pick(ITEMS)
        q = g.pick([f"{p.name} has {n} {pl}. {pct}% of them are red. How many red {pl} does {p.sub} have?",
                    f"Of the {n} {pl} in a box, {pct}% are broken. How many are broken?",
                    f"What is {pct}% of {n}?",
                    f"A class has {n} students and {pct}% of them walk to school. How many students walk?",
                    f"Find {pct} percent of {n}.", f"Calculate {pct}% of {n}.",
                    f"A farm has {n} animals, and {pct}% of them are sheep. How many sheep are there?",
                    f"{p.name} reads a book with {n} pages. So far {p.sub} has read {pct}% of it. How many pages "
                    f"has {p.sub} read?",
                    f"In a town of {n} people, {pct} percent ride bikes. How many people ride bikes?"])
        ans = g.op(f"{pct}% of {n} is", n, "*", Fraction(pct, 100))
    elif mode in ("increase", "decrease"):
        pct, price = g.pick([10, 20, 25, 50, 5, 40]), g.r(2, 100) * 4
        up = mode == "increase"
        q = g.pick([f"A {g.pick(['jacket', 'bike', 'game', 'phone', 'desk'])} costs ${price}. The price goes "
                    f"{'up' if up else 'down'} by {pct}%. What is the new price?",
                    f"{p.name} earns ${price} a week and gets a {pct}% {'raise' if up else 'pay cut'}. "
                    f"How much does {p.sub} earn a week now?",
                    f"The rent of ${price} a month is {'raised' if up else 'lowered'} by {pct}%. What is the rent now?",
                    f"A ${price} ticket becomes {pct}% {'more' if up else 'less'} expensive. What does it cost now?"])
        ch = g.op(f"{pct}% of {money(price)} is", price, "*", Fraction(pct, 100), money_=True)
        ans = g.op("The new amount is", price, "+" if up else "-", ch, money_=True)
    elif mode == "remaining":
        pct, n = g.pick([10, 20, 25, 40, 50, 75]), g.r(2, 100) * 4
        q = g.pick([f"{p.name} has ${n} and spends {pct}% of it. How much money is left?",
                     f"A tank holds {n} liters. {pct}% of the water is used. How many liters remain?",
                     f"{p.name} saved ${n}. {cap(p.sub)} spends {pct} percent of the savings on a gift. How many "
                     f"dollars are left?",
                     f"A road is {n} km long and {pct}% of it is paved. How many km are not paved yet?"])
        used = g.op(f"{pct}% of {n} is", n, "*", Fraction(pct, 100))
        ans = g.op("What remains is", n, "-", used)
    else:
        tot = g.pick([20, 25, 40, 50, 200, 10, 4, 5])
        part = g.ri(1, tot)
        q = g.pick([f"{p.name} answered {part} of {tot} questions correctly. What percent did {p.sub} get right?",
                    f"{part} out of {tot} seeds sprouted. What percentage sprouted?",
                    f"Of {tot} shots, {p.name} makes {part}. What percent of the shots go in?",
                    f"{part} of the {tot} students in a club are girls. What percentage of the club is girls?"])
        fr = g.op("The fraction is", part, "/", tot)
        ans = g.op("As a percent that is", fr, "*", 100)
    return q, ans


def f_rate(g):
    p = g.person()
    mode = g.pick(["speed", "wage", "work", "convert", "fill"])
    if mode == "speed":
        v, t = g.r(3, 80), g.ri(2, 12)
        if g.chance(0.5):
            q = g.pick([f"{p.name} drives at {v} miles per hour for {t} hours. How far does {p.sub} go?",
                        f"A train travels {v} km each hour. How many km does it cover in {t} hours?",
                        f"{p.name} walks at a steady {v} meters per minute. How many meters does {p.sub} walk in "
                        f"{t} minutes?",
                        f"Going {v} miles an hour, how far does a bus travel in {t} hours?",
                        f"A car keeps a speed of {v} km per hour for {t} hours. Find the distance it covers."])
            ans = g.op("Distance is speed times time:", v, "*", t)
        else:
            d = v * t
            q = g.pick([f"{p.name} cycles {d} km in {t} hours. What is {p.pos} average speed in km per hour?",
                        f"A boat goes {d} miles in {t} hours at a steady speed. How fast is it, in miles per hour?",
                        f"A runner covers {d} meters in {t} minutes. How many meters per minute is that?",
                        f"It takes {p.name} {t} hours to drive {d} miles. What is {p.pos} speed in miles per hour?"])
            ans = g.op("Speed is distance over time:", d, "/", t)
    elif mode == "wage":
        w, h, days = g.r(8, 40), g.ri(2, 10), g.ri(2, 7)
        q = g.pick([f"{p.name} earns ${w} an hour. {cap(p.sub)} works {h} hours a day for {days} days. "
                    f"How much does {p.sub} earn?",
                    f"For {days} days, {p.name} works {h} hours each day at ${w} per hour. What is {p.pos} pay?",
                    f"{p.name} is paid ${w} per hour and works {h} hours on each of {days} days. How many dollars "
                    f"does {p.sub} make?",
                    f"At a rate of ${w} an hour, {p.name} works {h}-hour shifts on {days} days. Find {p.pos} total "
                    f"earnings."])
        hrs = g.op(f"{cap(p.sub)} works", h, "*", days, "hours")
        ans = g.op("The pay is", hrs, "*", w, money_=False)
    elif mode == "work":
        r1, t = g.r(2, 30), g.ri(2, 12)
        s, pl = g.pick(ITEMS)
        n_workers = g.ri(2, 6)
        q = g.pick([f"One machine makes {r1} {pl} per hour. How many {pl} do {n_workers} machines make in {t} hours?",
                    f"Each of {n_workers} workers packs {r1} {pl} an hour. How many {pl} are packed in {t} hours?",
                    f"{n_workers} robots each make {r1} {pl} every hour. How many {pl} do they make in {t} hours?",
                    f"A team of {n_workers} people paint {r1} {pl} per hour each. Find how many {pl} they paint in "
                    f"{t} hours."])
        per = g.op("Together they make", r1, "*", n_workers, f"{pl} per hour")
        ans = g.op(f"In {t} hours that is", per, "*", t, pl)
    elif mode == "convert":
        big1, bigp, k, small = g.pick(UNITS_TIME + UNITS_LEN)
        n = g.r(2, 40)
        if g.chance(0.5):
            extra = g.ri(1, k - 1)
            q = g.pick([f"How many {small} are in {n} {bigp} and {extra} {small}?",
                        f"{p.name} spends {n} {bigp} and {extra} {small} on a project. How many {small} is that?"])
            m = g.op(f"{n} {bigp} is", n, "*", k, small)
            ans = g.op("Adding the rest gives", m, "+", extra, small)
        else:
            m = n * k
            q = g.pick([f"How many {bigp} is {m} {small}?", f"{p.name} has {m} {small}. How many {bigp} is that?"])
            ans = g.op("Dividing by", m, "/", k, bigp)
    else:
        cap_, rate = g.r(10, 100) * 6, g.pick([2, 3, 4, 5, 6, 10])
        if cap_ % rate:
            raise Reject("fill")
        q = g.pick([f"A pool holds {cap_} liters and a hose fills {rate} liters per minute. How many minutes does "
                    f"it take to fill the empty pool?",
                    f"A printer prints {rate} pages a minute. How long does it take to print {cap_} pages, in minutes?"])
        ans = g.op("It takes", cap_, "/", rate, "minutes")
    return q, ans


def f_average(g):
    p = g.person()
    k = g.ri(2, 6)
    vals = [g.r(10, 100) for _ in range(k)]
    mode = g.pick(["mean", "mean", "needed"])
    if mode == "mean":
        things = g.pick([("test scores", "points"), ("daily steps", "steps"), ("weights", "kg"),
                         ("heights", "cm"), ("rides", "minutes")])
        q = g.pick([f"{p.name}'s {things[0]} are {', '.join(map(str, vals[:-1]))} and {vals[-1]}. What is the average?",
                    f"The numbers {', '.join(map(str, vals))} are written on a board. What is their mean?",
                    f"Over {k} days {p.name} reads {', '.join(map(str, vals[:-1]))} and {vals[-1]} pages. "
                    f"How many pages does {p.sub} read per day on average?",
                    f"Find the mean of {', '.join(map(str, vals[:-1]))} and {vals[-1]}.",
                    f"{p.name} records {', '.join(map(str, vals))} as {p.pos} {things[0]}. What is the mean value?",
                    f"What is the average of the numbers {', '.join(map(str, vals))}?",
                    f"On {k} trips, {p.name} drives {', '.join(map(str, vals[:-1]))} and {vals[-1]} miles. What is "
                    f"the average distance per trip?"])
        tot = Fraction(vals[0])
        for v in vals[1:]:
            tot = g.op("Adding up:", tot, "+", v)
        ans = g.op(f"There are {k} numbers, so the average is", tot, "/", k)
    else:
        target = g.r(50, 95)
        q = g.pick([f"{p.name} scored {', '.join(map(str, vals))} on {k} tests. What must {p.sub} score on the next "
                    f"test to average {target} over all {k + 1} tests?",
                    f"After {k} games with {', '.join(map(str, vals))} points, how many points does {p.name} need in "
                    f"game {k + 1} for an average of {target}?",
                    f"{p.name}'s first {k} quiz scores are {', '.join(map(str, vals))}. Which score on quiz {k + 1} "
                    f"makes {p.pos} average exactly {target}?"])
        need = g.op(f"An average of {target} over {k + 1} tests needs", target, "*", k + 1, "points")
        tot = Fraction(vals[0])
        for v in vals[1:]:
            tot = g.op("So far:", tot, "+", v)
        ans = g.op(f"{cap(p.sub)} needs", need, "-", tot, "points")
    return q, ans


def f_backwards(g):
    """Start unknown: events applied, end known; undo them in reverse."""
    p = g.person()
    s, pl = g.pick(ITEMS)
    start = g.r(5, 120)
    events, cur = [], Fraction(start)
    for _ in range(g.pick([1, 2, 2, 3, 4])):
        kind = g.pick(["give", "buy", "half"])
        if kind == "half" and cur % 2 == 0:
            events.append(("half", 2))
            cur /= 2
        elif kind == "give" and cur > 3:
            d = g.ri(1, int(cur) - 1)
            events.append(("give", d))
            cur -= d
        else:
            d = g.r(1, 40)
            events.append(("buy", d))
            cur += d
    text = {"give": [f"{cap(p.sub)} gives away {{d}} {pl}.", f"Then {p.sub} loses {{d}} {pl}."],
            "buy": [f"{cap(p.sub)} buys {{d}} more {pl}.", f"{cap(p.sub)} finds {{d}} more {pl}."],
            "half": [f"{cap(p.sub)} gives half of {p.pos} {pl} to a friend.",
                     f"{cap(p.sub)} sells half of the {pl} {p.sub} has."]}
    q = [g.pick([f"{p.name} has some {pl}.", f"{p.name} starts the day with some {pl}."])]
    for kind, d in events:
        q.append(g.pick(text[kind]).format(d=d))
    q.append(g.pick([f"Now {p.sub} has {fmt(cur)} {pl}. How many {pl} did {p.sub} have at first?",
                     f"{cap(p.sub)} ends with {fmt(cur)} {pl}. How many did {p.sub} start with?"]))
    g.say("Work backwards from the end.")
    for kind, d in reversed(events):
        if kind == "half":
            cur = g.op(f"Before giving half, {p.sub} had", cur, "*", 2, pl)
        elif kind == "give":
            cur = g.op(f"Before giving {d} away, {p.sub} had", cur, "+", d, pl)
        else:
            cur = g.op(f"Before getting {d}, {p.sub} had", cur, "-", d, pl)
    return " ".join(q), cur


def f_compare(g):
    a, b = g.person(), g.person()
    s, pl = g.pick(ITEMS)
    x = g.r(5, 150)
    mode = g.pick(["more", "fewer", "times", "diff", "total"])
    if mode == "more":
        d = g.r(2, 60)
        facts = [f"{a.name} {g.pick(HAS)} {x} {pl}.", g.pick([f"{b.name} has {d} more {pl} than {a.name}.",
                                                   f"{b.name} has {d} {pl} more than {a.name} does.",
                                                   f"{b.name} owns {d} more {pl} than {a.name} owns.",
                                                   f"{a.name} has {d} fewer {pl} than {b.name}."])]
        y = g.op(f"{b.name} has", x, "+", d, pl)
    elif mode == "fewer":
        d = g.r(1, x - 1) if x > 2 else 1
        facts = [f"{a.name} {g.pick(HAS)} {x} {pl}.", g.pick([f"{b.name} has {d} fewer {pl} than {a.name}.",
                                                   f"{b.name} has {d} less than {a.name}.",
                                                   f"{a.name} has {d} more {pl} than {b.name}.",
                                                   f"{b.name} keeps {d} fewer {pl} than {a.name} does."])]
        y = g.op(f"{b.name} has", x, "-", d, pl)
    elif mode == "times":
        k = g.ri(2, 6)
        facts = [f"{a.name} {g.pick(HAS)} {x} {pl}.", g.pick([f"{b.name} has {k} times as many {pl} as {a.name}.",
                                                   f"{b.name} owns {k} times the number {a.name} owns.",
                                                   f"{b.name} has {k} times the amount of {pl} {a.name} has."])]
        y = g.op(f"{b.name} has", x, "*", k, pl)
    else:
        y = g.r(5, 150)
        facts = [f"{a.name} has {x} {pl}.", f"{b.name} has {y} {pl}."]
        y = Fraction(y)
    if g.chance(0.4):
        facts.reverse() if mode in ("diff", "total") else None
    qmode = g.pick(["how_many_b", "total", "diff"]) if mode not in ("diff", "total") else mode
    if qmode == "how_many_b":
        qq = g.pick([f"How many {pl} does {b.name} have?", f"How many {pl} does {b.name} own?",
                     f"Find the number of {pl} {b.name} has.", f"What is {b.name}'s number of {pl}?"])
        ans = y
    elif qmode == "total":
        qq = g.pick([f"How many {pl} do they have together?", f"How many {pl} do {a.name} and {b.name} have in all?",
                     f"What is the total number of {pl} the two of them have?",
                     f"What total number of {pl} do {a.name} and {b.name} have?",
                     f"Find how many {pl} the two have combined.", f"How many {pl} are there in all?"])
        ans = g.op("Together they have", x, "+", y, pl)
    else:
        if y >= x:
            qq = g.pick([f"How many more {pl} does {b.name} have than {a.name}?",
                         f"How many fewer {pl} does {a.name} have than {b.name}?"])
            ans = g.op("The difference is", y, "-", x, pl)
        else:
            qq = g.pick([f"How many fewer {pl} does {b.name} have than {a.name}?",
                         f"How many more {pl} does {a.name} have than {b.name}?"])
            ans = g.op("The difference is", x, "-", y, pl)
    return _join(g, facts, qq), ans


def f_share(g):
    """Equal sharing with remainders, decimals, groups needed (rounding up)."""
    p = g.person()
    s, pl = g.pick(ITEMS)
    n, k = g.r(10, 300), g.ri(2, 12)
    mode = g.pick(["each", "left", "groups", "decimal"])
    if mode == "each":
        n = n - n % k
        q = g.pick([f"{p.name} shares {n} {pl} equally among {k} friends. How many does each friend get?",
                    f"{n} {pl} are split evenly into {k} bags. How many {pl} go in each bag?"])
        ans = g.op("Each gets", n, "/", k, pl)
    elif mode == "left":
        if n % k == 0:
            n += 1
        q = g.pick([f"{p.name} puts {n} {pl} into bags of {k}. How many {pl} are left over?",
                    f"{n} {pl} are shared equally among {k} children, as many as possible each. How many are left?"])
        full = n // k
        g.say(f"{n} = {k} * {full} + {n - full * k}, so {full} full groups and {n - full * k} left.")
        ans = g.op("The leftover is", n, "-", k * full, pl)
    elif mode == "groups":
        if n % k == 0:
            n += g.ri(1, k - 1)
        q = g.pick([f"{n} people need rides and each van seats {k}. How many vans are needed?",
                    f"{p.name} packs {n} {pl} into boxes that hold {k} each. How many boxes does {p.sub} need?"])
        full = n // k
        g.say(f"{n} = {k} * {full} + {n - full * k}, so {full} are full and one more is needed.")
        ans = g.op("The number needed is", full, "+", 1)
    else:
        k = g.pick([2, 4, 5, 8, 10])
        n = g.r(3, 99)
        if n % k == 0:
            n += 1
        q = g.pick([f"{n} liters of juice are poured equally into {k} jugs. How many liters are in each jug?",
                    f"{p.name} cuts a {n} meter rope into {k} equal pieces. How long is each piece in meters?"])
        ans = g.op("Each part is", n, "/", k)
    return q, ans


def f_negative(g):
    p = g.person()
    mode = g.pick(["temp", "balance", "floor"])
    if mode == "temp":
        t0, drop = g.r(-10, 15), g.r(5, 30)
        q = g.pick([f"The temperature is {t0} degrees in the evening and drops {drop} degrees overnight. "
                    f"What is the temperature in the morning?",
                    f"It was {t0} degrees at noon. By midnight it was {drop} degrees colder. What was the temperature "
                    f"at midnight?"])
        ans = g.op("The temperature is", t0, "-", drop, "degrees")
        if g.chance(0.5):
            rise = g.r(2, 20)
            q = q.replace("What is", f"Then it rises {rise} degrees. What is").replace(
                "What was", f"Then it rose {rise} degrees. What was")
            ans = g.op("After the rise it is", ans, "+", rise, "degrees")
    elif mode == "balance":
        b0, spend = g.r(10, 200), g.r(50, 400)
        q = g.pick([f"{p.name} has ${b0} in the bank and pays a ${spend} bill. What is the balance now?",
                    f"{p.name}'s account holds ${b0}. {cap(p.sub)} spends ${spend}. What is the new balance?"])
        ans = g.op("The balance is", b0, "-", spend, money_=True)
    else:
        f0, down = g.r(0, 12), g.r(3, 20)
        q = g.pick([f"An elevator is at floor {f0} and goes down {down} floors. Which floor is it on now? "
                    f"(Floors below ground are negative.)",
                    f"A diver is {f0} meters above the water and goes down {down} meters. What is the diver's height "
                    f"now, with the surface at 0?"])
        ans = g.op("It ends at", f0, "-", down)
    return q, ans


def f_group_total(g):
    """Several people with related amounts; total or one of them (2-6 steps)."""
    ps = [g.person() for _ in range(g.ri(2, 4))]
    s, pl = g.pick(ITEMS)
    x = g.r(4, 60)
    vals = [Fraction(x)]
    facts = [f"{ps[0].name} has {x} {pl}."]
    for i in range(1, len(ps)):
        prev = ps[i - 1]
        rel = g.pick(["more", "fewer", "twice", "half"])
        v = vals[-1]
        if rel == "more":
            d = g.r(1, 30)
            facts.append(f"{ps[i].name} has {d} more than {prev.name}.")
            vals.append(g.op(f"{ps[i].name} has", v, "+", d, pl))
        elif rel == "fewer" and v > 2:
            d = g.ri(1, int(v) - 1)
            facts.append(f"{ps[i].name} has {d} fewer than {prev.name}.")
            vals.append(g.op(f"{ps[i].name} has", v, "-", d, pl))
        elif rel == "half" and v % 2 == 0:
            facts.append(f"{ps[i].name} has half as many as {prev.name}.")
            vals.append(g.op(f"{ps[i].name} has", v, "/", 2, pl))
        else:
            facts.append(f"{ps[i].name} has twice as many as {prev.name}.")
            vals.append(g.op(f"{ps[i].name} has", v, "*", 2, pl))
    names = ", ".join(p.name for p in ps[:-1]) + " and " + ps[-1].name
    qq = g.pick([f"How many {pl} do {names} have in total?", f"How many {pl} do they have altogether?",
                 f"Altogether, how many {pl} do the {len(ps)} friends have?",
                 f"What is the total number of {pl} the {len(ps)} of them have?",
                 f"Determine how many {pl} the group has in all.", f"How many {pl} are there in all?",
                 f"Find the combined number of {pl}."])
    tot = vals[0]
    for v in vals[1:]:
        tot = g.op("Adding up gives", tot, "+", v, pl)
    return _join(g, facts, qq, distract=0.4), tot


def f_geometry(g):
    p = g.person()
    w, h = g.r(2, 40), g.r(2, 40)
    place = g.pick(["garden", "room", "field", "rug", "poster", "yard", "table top"])
    mode = g.pick(["area", "perimeter", "fence_cost", "tiles"])
    q = g.pick([f"{p.name}'s {place} is {w} meters long and {h} meters wide.",
                f"A rectangular {place} measures {w} m by {h} m."])
    if mode == "area":
        q += " " + g.pick([f"What is its area in square meters?", f"How many square meters does it cover?"])
        ans = g.op("The area is", w, "*", h, "square meters")
    elif mode == "perimeter":
        q += " " + g.pick(["What is its perimeter?", f"How many meters of fence go around it?"])
        s = g.op("Length plus width is", w, "+", h, "meters")
        ans = g.op("The perimeter is", s, "*", 2, "meters")
    elif mode == "fence_cost":
        c = g.ri(2, 15)
        q += f" Fencing costs ${c} per meter. How much does it cost to fence all the way around?"
        s = g.op("Length plus width is", w, "+", h, "meters")
        per = g.op("The perimeter is", s, "*", 2, "meters")
        ans = g.op("The cost is", per, "*", c, money_=True)
    else:
        c = g.ri(2, 9)
        q += f" Each square meter needs {c} tiles. How many tiles are needed?"
        a = g.op("The area is", w, "*", h, "square meters")
        ans = g.op("The tiles needed are", a, "*", c, "tiles")
    return q, ans


def f_time(g):
    p = g.person()
    mode = g.pick(["total_min", "week", "schedule"])
    if mode == "total_min":
        a, b, c = g.r(5, 50), g.r(5, 50), g.r(5, 50)
        q = g.pick([f"{p.name} spends {a} minutes on math, {b} minutes on reading and {c} minutes on music. How many "
                    f"minutes is that in all?",
                    f"A movie has three parts of {a}, {b} and {c} minutes. How long is it in minutes?"])
        t = g.op("First two parts:", a, "+", b, "minutes")
        ans = g.op("All together:", t, "+", c, "minutes")
        if g.chance(0.4) and ans % 60 == 0:
            q = q.replace("How many minutes is that in all?", "How many hours is that in all?").replace(
                "How long is it in minutes?", "How long is it in hours?")
            ans = g.op("In hours that is", ans, "/", 60, "hours")
    elif mode == "week":
        d, k = g.r(2, 60), g.pick([2, 3, 4, 5, 6, 8, 10, 52])
        q = g.pick([f"{p.name} runs {d} km every day. How many km does {p.sub} run in {k} weeks?",
                    f"A bakery sells {d} loaves a day. How many loaves does it sell in {k} weeks?"])
        days = g.op(f"{k} weeks have", k, "*", 7, "days")
        ans = g.op("The total is", days, "*", d)
    else:
        start, dur = g.ri(6, 11), g.ri(2, 9)
        q = g.pick([f"A shop opens at {start} in the morning and stays open for {dur} hours. After how many hours "
                    f"past noon does it close?",
                    f"{p.name} starts work at {start} a.m. and works {dur} hours. How many hours after noon does "
                    f"{p.sub} finish?"])
        end = g.op("It ends at hour", start, "+", dur)
        ans = g.op("Past noon that is", end, "-", 12, "hours")
    return q, ans


FAMILIES = [(f_inventory, 5), (f_shopping, 3), (f_percent, 2), (f_rate, 3), (f_average, 2),
            (f_backwards, 2), (f_compare, 3), (f_share, 2), (f_negative, 1), (f_group_total, 2),
            (f_geometry, 2), (f_time, 2)]


# ------------------------------------------------------------------------------------------------
# Question rewording: the final question of any family said another way ("How many pens does Leo
# need?" -> "Determine how many pens Leo needs.", "What is the new price?" -> "Find the new
# price."), so no family's question is tied to one wording.

_IRREG = {"have": "has", "do": "does", "go": "goes"}
_SUBJ1 = r"(?:he|she|it|[A-Z][a-z]+|the [a-z]+)"        # singular subjects taken by "does"
_SUBJN = r"(?:they|[A-Z][a-z]+ and [A-Z][a-z]+|the \d+ [a-z]+)"  # plural subjects taken by "do"


def third_person(verb):
    if verb in _IRREG:
        return _IRREG[verb]
    if re.search(r"(?:s|sh|ch|x|z)$", verb):
        return verb + "es"
    if re.search(r"[^aeiou]y$", verb):
        return verb[:-1] + "ies"
    return verb + "s"


def reword_question(g, text):
    """text with its final question reworded (or unchanged when no rule fits it)."""
    m = re.match(r"^(.*?)([^.?!]*\?)$", text)
    if not m or "(" in m.group(2):
        return text
    head, qn = m.group(1), m.group(2).strip()
    lead = g.pick(["Determine", "Find", "Work out", "Calculate", "Figure out", "Find out"])
    mm = re.match(rf"^How (many|much)( [a-z ]+?)? (does|do) ({_SUBJN}|{_SUBJ1}) ([a-z]+)(.*)\?$", qn)
    if mm:
        many, noun, aux, subj, verb, rest = mm.groups()
        noun = noun or ""
        if aux == "does" and not re.fullmatch(_SUBJ1, subj):
            return text
        if aux == "do" and not re.fullmatch(_SUBJN, subj):
            return text
        v = third_person(verb) if aux == "does" else verb
        opts = [f"{lead} how {many}{noun} {subj} {v}{rest}.", f"Tell me how {many}{noun} {subj} {v}{rest}."]
        if many == "many" and noun and not re.match(r" (?:more|fewer|less) ", noun):
            opts += [f"What is the number of{noun} {subj} {v}{rest}?",
                     f"{lead} the number of{noun} that {subj} {v}{rest}."]
        if many == "much":
            opts += [f"What amount does {subj} {verb}{rest}?" if aux == "does" else
                     f"What amount do {subj} {verb}{rest}?"]
        new = g.pick(opts)
    else:
        mm = re.match(r"^What (is|was|are) (the|its|their|his|her) (.+)\?$", qn)
        if not mm:
            return text
        new = g.pick([f"{lead} {mm.group(2)} {mm.group(3)}.", f"Tell me {mm.group(2)} {mm.group(3)}.",
                      f"{lead} {mm.group(2)} {mm.group(3)}."])
    sp = "" if not head or head.endswith(" ") else " "
    return head + sp + cap(new)


# ------------------------------------------------------------------------------------------------
# Arithmetic practice rows: "Question: What is 347 * 28?" with the same worked steps.

_WORD_OPS = {
    "+": ["What is the sum of {a} and {b}?", "Add {a} and {b}.", "What is {a} plus {b}?",
          "What do you get when you add {b} to {a}?", "Find the total of {a} and {b}."],
    "-": ["What is {a} minus {b}?", "Subtract {b} from {a}.", "What is the difference of {a} and {b}?",
          "Take {b} away from {a}. What is left?", "How much is {a} less {b}?"],
    "*": ["What is {a} times {b}?", "What is the product of {a} and {b}?", "Multiply {a} by {b}.",
          "What do you get when you multiply {a} by {b}?", "Find {a} multiplied by {b}."],
    "/": ["What is {a} divided by {b}?", "Divide {a} by {b}.", "What is the quotient of {a} and {b}?",
          "How many times does {b} go into {a}?", "Split {a} into {b} equal parts. How big is each part?"],
}


def big_arithmetic(g):
    """Numbers far outside the word problems' ranges: 4-7 digit sums and differences, 3-4 by 2-3
    digit products, 5-7 digit quotients by a 1-2 digit divisor; every result below 10**7."""
    op = g.pick(["+", "-", "*", "/"])
    if op in "+-":
        a, b = g.ri(1000, 9_999_999), g.ri(100, 9_999_999)
        if op == "+" and a + b >= 10 ** 7:
            raise Reject("big")
    elif op == "*":
        a, b = g.ri(100, 9999), g.ri(10, 999)
        if a * b >= 10 ** 7:
            raise Reject("big")
    else:
        b = g.ri(2, 99)
        qv = g.ri(1000, 9_999_999 // b)
        a = b * qv
    word = g.chance(0.5)
    q = g.pick(_WORD_OPS[op]).format(a=a, b=b) if word else g.pick(
        ["What is {e}?", "Compute {e}.", "Calculate {e}.", "{e} = ?", "Work out {e}."]).format(e=f"{a} {op} {b}")
    ans = g.op("", a, op, b)
    g.steps = [re.sub(r"^ ", "", x) for x in g.steps]
    return q, ans


def arithmetic(g):
    if g.chance(0.35):
        return big_arithmetic(g)
    op = g.pick(["+", "-", "*", "/", "/r", "chain"])
    digits = g.pick([1, 2, 2, 3, 3, 4])
    a = g.ri(1, 10 ** digits - 1)
    b = g.ri(1, 10 ** g.pick([1, 1, 2, 2, 3]) - 1)
    if g.chance(0.1):
        a = -a
    phr = g.pick(["What is {e}?", "Compute {e}.", "Calculate {e}.", "Find {e}.", "What is the value of {e}?",
                  "Work out {e}.", "{e} = ?"])
    if op in "+-*":
        if op == "*" and abs(a) * b > 10 ** 7:
            raise Reject("big")
        q = phr.format(e=f"{a} {op} {b}")
        if a > 0 and g.chance(0.3):
            q = g.pick(_WORD_OPS[op]).format(a=a, b=b)
        ans = g.op("", a, op, b)
    elif op == "/":
        if g.chance(0.6):
            a = abs(a) - abs(a) % b if b > 1 else abs(a)
            if a == 0:
                raise Reject("zero")
        q = phr.format(e=f"{a} / {b}")
        if a > 0 and g.chance(0.3):
            q = g.pick(_WORD_OPS["/"][:3]).format(a=a, b=b)
        fr = Fraction(a, b)
        if (fr * 100).denominator != 1:
            q = g.pick([f"What is {a} divided by {b}, rounded down to a whole number?",
                        f"How many whole times does {b} go into {a}?"])
            if a < 0:
                raise Reject("neg floor")
            qq = a // b
            g.say(f"{a} = {b} * {qq} + {a - b * qq}, so {b} goes into {a} {qq} whole times.")
            ans = Fraction(qq)
        else:
            ans = g.op("", a, "/", b)
    elif op == "/r":
        a, b = abs(a) + 1, max(2, b % 50)
        q = g.pick([f"What is the remainder when {a} is divided by {b}?", f"What is {a} mod {b}?",
                    f"{a} items are packed {b} to a box. How many items are left over?"])
        qq = a // b
        m = g.op(f"{b} goes into {a} {qq} times:", b, "*", qq)
        ans = g.op("The remainder is", a, "-", m)
    else:
        x, y, z = g.ri(1, 99), g.ri(1, 99), g.ri(1, 20)
        o1, o2 = g.pick("+-"), g.pick("+-*")
        if o2 == "*":
            q = phr.format(e=f"{x} {o1} {y} * {z}")
            m = g.op("Multiplication first:", y, "*", z)
            ans = g.op("Then", x, o1, m)
        else:
            q = phr.format(e=f"{x} {o1} {y} {o2} {z}")
            m = g.op("Left to right:", x, o1, y)
            ans = g.op("Then", m, o2, z)
    g.steps = [re.sub(r"^ ", "", s) for s in g.steps]
    return q, ans


# ------------------------------------------------------------------------------------------------
# Problems and formats

def normalize(question):
    return " ".join(question.lower().split())


def _check_value(ans):
    if abs(ans) > 10 ** 7:
        raise Reject("too big")
    fmt(ans)


def one_problem(rng, arithmetic_share=0.15):
    fams, weights = zip(*FAMILIES)
    for _ in range(1000):
        g = Gen(rng, big=rng.random() < 0.15)
        try:
            if rng.random() < arithmetic_share:
                name = "arithmetic"
                q, ans = arithmetic(g)
            else:
                fam = rng.choices(fams, weights)[0]
                name = fam.__name__
                q, ans = fam(g)
                if rng.random() < 0.3:
                    q = reword_question(g, q)
            _check_value(ans)
            if not g.steps:
                g.say(f"The answer is {fmt(ans)}.")
        except Reject:
            continue
        return {"question": q, "solution": "\n".join(g.steps), "answer": fmt(ans), "family": name}
    raise RuntimeError("no family satisfied its constraints in 1000 draws")


def make_problems(split, n, seed, with_template=False):
    """n problems {question, solution, answer}.  split "train" draws from any seed and excludes
    the questions of the held-out seed's first 2000 problems; "heldout" is that fixed draw."""
    if split == "heldout" or split == "test":
        probs = _heldout(max(n, 0))[:n]
    elif split == "train":
        rng = random.Random(f"gsm2:{seed}")
        held = _heldout_keys()
        probs = []
        while len(probs) < n:
            p = one_problem(rng)
            if normalize(p["question"]) not in held:
                probs.append(p)
    else:
        raise ValueError(f"unknown split {split!r}")
    return [p if with_template else {k: p[k] for k in ("question", "solution", "answer")} for p in probs]


_HELD = None
HELDOUT_SIZE = 2000


def _heldout(n):
    global _HELD
    if _HELD is None:
        rng = random.Random(f"gsm2-heldout:{HELDOUT_SEED}")
        seen, out = set(), []
        while len(out) < HELDOUT_SIZE:
            p = one_problem(rng, arithmetic_share=0.0)
            k = normalize(p["question"])
            if k not in seen:
                seen.add(k)
                out.append(p)
        _HELD = out
    if n > HELDOUT_SIZE:
        raise ValueError(f"the held-out draw has {HELDOUT_SIZE} problems")
    return _HELD


def _heldout_keys():
    return frozenset(normalize(p["question"]) for p in _heldout(HELDOUT_SIZE))


def format_example(p):
    return "Question: " + p["question"] + "\nAnswer: " + p["solution"] + "\n#### " + str(p["answer"])


def few_shot_prompt(question, shots):
    head = "\n\n".join(s if isinstance(s, str) else format_example(s) for s in shots)
    tail = "Question: " + question + "\nAnswer:"
    return head + "\n\n" + tail if head else tail


def fewshot_examples():
    return make_problems("train", 4, FEWSHOT_SEED)


# ------------------------------------------------------------------------------------------------
# Chat conversations

SYSTEMS = ["You are a helpful assistant.", "You solve math word problems step by step.",
           "You are a math tutor. Show your working and end with the answer.",
           "Answer the user's math question.", "You are a careful assistant that checks arithmetic."]
GREETINGS = ["Hello!", "Hi", "Hi there!", "Hey", "Good morning!", "hello", "Hey, how are you?",
             "Hi! Who are you?", "What can you do?", "Are you there?", "Thanks!", "Thank you very much!",
             "Good evening.", "Yo", "Hello, assistant.", "Can you help me?"]
GREET_REPLIES = [
    "Hello! I can solve math word problems and arithmetic step by step. Send me a problem.",
    "Hi! Give me a math word problem and I will work it out step by step.",
    "Hello! I am a small model for math word problems. Ask me one and I will solve it.",
]
THANKS_REPLIES = ["You're welcome! Send another math problem any time.",
                  "Glad to help. Do you have another word problem?"]
OFF_TOPIC = ["Write a poem about the sea.", "What is the capital of France?", "Tell me a joke.",
             "Translate 'good night' into Spanish.", "Who won the World Cup in 2010?",
             "Write a Python function that sorts a list.", "What is the weather today?",
             "Summarize the history of Rome.", "Can you recommend a movie?", "What is love?",
             "Write an email to my boss.", "How do I bake bread?", "Explain quantum physics.",
             "What's your favorite color?", "Tell me about yourself in detail."]
OFF_REPLIES = ["Sorry, I can only help with math word problems and arithmetic. Give me a problem and I will "
               "solve it step by step.",
               "I am only trained to solve math word problems. Try asking me one, for example: "
               "\"Tom has 5 apples and buys 3 more. How many does he have?\"",
               "That is outside what I can do. I solve math word problems step by step; send me one."]
USER_WRAPS = ["{q}", "{q}", "{q}", "Solve this: {q}", "Can you help me with this problem? {q}", "{q} Show your work.",
              "Question: {q}", "Please solve: {q}", "{q}\nThanks!", "Here is a word problem. {q}"]


def _answer_messages(rng, p, thinking):
    """The assistant message for a problem: working in think (thinking mode) or in the response."""
    final = rng.choice(["The answer is {a}.", "So the answer is {a}.", "{a}"]).format(a=p["answer"])
    if thinking:
        return {"role": "assistant", "reasoning_content": p["solution"],
                "content": final + "\n#### " + p["answer"]}
    return {"role": "assistant", "content": p["solution"] + "\n#### " + p["answer"]}


def make_chat(rng, probs):
    """One conversation: (messages, thinking).  probs: problems to use (1-2 consumed)."""
    thinking = rng.random() < 0.7
    msgs = []
    if rng.random() < 0.4:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    kind = rng.random()
    if kind < 0.12:
        g = rng.choice(GREETINGS)
        msgs.append({"role": "user", "content": g})
        rep = rng.choice(THANKS_REPLIES if g.lower().startswith("thank") else GREET_REPLIES)
        msgs.append({"role": "assistant", "content": rep, **({"reasoning_content": ""} if thinking else {})})
        if rng.random() < 0.5:
            p = probs.pop()
            msgs.append({"role": "user", "content": rng.choice(USER_WRAPS).format(q=p["question"])})
            msgs.append(_answer_messages(rng, p, thinking))
    elif kind < 0.22:
        msgs.append({"role": "user", "content": rng.choice(OFF_TOPIC)})
        msgs.append({"role": "assistant", "content": rng.choice(OFF_REPLIES)})
    else:
        for _ in range(1 if rng.random() < 0.8 else 2):
            p = probs.pop()
            msgs.append({"role": "user", "content": rng.choice(USER_WRAPS).format(q=p["question"])})
            msgs.append(_answer_messages(rng, p, thinking))
    return msgs, thinking


def make_stream_items(n, seed, chat_share=0.3):
    """n training items for tools/train/data.py: ("text", formatted example) or
    ("chat", messages, thinking)."""
    rng = random.Random(f"gsm2-items:{seed}")
    probs = make_problems("train", n + n // 2 + 4, seed)
    items = []
    while len(items) < n:
        if rng.random() < chat_share and len(probs) > 2:
            msgs, thinking = make_chat(rng, probs)
            items.append(("chat", msgs, thinking))
        else:
            items.append(("text", format_example(probs.pop())))
    return items


# ------------------------------------------------------------------------------------------------
# Self-check: recompute every equation of the working

_NUM = r"-?\$?\d+(?:\.\d+)?"
_EQ = re.compile(rf"({_NUM}) ([-+*/]) ({_NUM}) = ({_NUM})(?![\d.])")


def _val(s):
    return Fraction(s.replace("$", ""))


def check_problem(p):
    """Every `a op b = c` in the working is right (place-value chains included), the answer line
    is the last result, and the working has 1..16 lines."""
    sol, ans = p["solution"], Fraction(p["answer"])
    lines = sol.split("\n")
    assert 1 <= len(lines) <= 16, p
    assert "\n\n" not in p["question"] and "\n" not in p["question"], p
    for line in lines:
        for chain in re.findall(r"[-$\d. ()+*/=]+", line):
            parts = [x.strip() for x in chain.split("=")]
            vals = []
            for part in parts:
                part = part.replace("$", "")
                if not part or not re.fullmatch(r"[-\d. ()+*/]+", part) or not re.search(r"\d", part):
                    vals = []
                    break
                try:
                    exact = re.sub(r"(\d+(?:\.\d+)?)", r"F('\1')", part)
                    vals.append(Fraction(eval(exact, {"__builtins__": {}, "F": Fraction}, {})))  # noqa: S307
                except (SyntaxError, ZeroDivisionError):
                    vals = []
                    break
            if len(vals) >= 2:
                assert all(v == vals[0] for v in vals), f"{chain!r} in {p}"
    nums = [_val(x) for x in re.findall(r"-?\$?\d+(?:\.\d+)?", lines[-1].replace("$-", "-$"))]
    assert ans in nums, p
    return True


def self_test_reword():
    """reword_question keeps the meaning: the verb agrees with the subject, the numbers stay."""
    rng = random.Random(5)
    cases = [("Leo has 5 pens. How many pens does Leo need?", r"Leo has 5 pens\. .*\bLeo needs\b"),
             ("How much does Mia spend in total?", r"(?:\bMia spends in total\.|^What amount does Mia spend in total\?)"),
             ("How many apples do Mia and Leo have in all?", r"\bMia and Leo have in all\b"),
             ("How many boxes does he need to pack 12 cups?", r"\bhe needs to pack 12 cups\b"),
             ("A bike costs $30. What is the new price?", r"A bike costs \$30\. .*\bthe new price\b"),
             ("Which floor is it on now? (Floors below ground are negative.)", r"^Which floor is it on now\?")]
    for q, pat in cases:
        for _ in range(8):
            got = reword_question(Gen(rng), q)
            assert re.search(pat, got), f"reword_question({q!r}) gave {got!r}"
    assert [third_person(v) for v in ("have", "need", "watch", "carry", "pay", "go")] == [
        "has", "needs", "watches", "carries", "pays", "goes"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write JSON lines {question, solution, answer}")
    ap.add_argument("--self-check", type=int, metavar="N")
    ap.add_argument("--chat", type=int, metavar="N", help="print N stream items")
    a = ap.parse_args(argv)
    if a.self_check:
        probs = make_problems("train", a.self_check, a.seed, with_template=True)
        fam = {}
        for p in probs:
            check_problem(p)
            fam[p["family"]] = fam.get(p["family"], 0) + 1
        want = {f.__name__ for f, _ in FAMILIES} | {"arithmetic"}
        assert a.self_check < 2000 or set(fam) == want, f"families never drawn: {want - set(fam)}"
        big = [p for p in probs if p["family"] == "arithmetic" and abs(Fraction(p["answer"])) >= 10 ** 6]
        assert a.self_check < 2000 or big, "no arithmetic row with a 7-digit result"
        self_test_reword()
        steps = [len(p["solution"].split("\n")) for p in probs]
        print(f"ok: {len(probs)} problems checked; families {fam}; lines min/mean/max "
              f"{min(steps)}/{sum(steps) / len(steps):.2f}/{max(steps)}; distinct questions "
              f"{len({normalize(p['question']) for p in probs})}")
        return 0
    if a.chat:
        for it in make_stream_items(a.chat, a.seed):
            print(json.dumps(it, indent=1))
        return 0
    probs = make_problems("train", a.n, a.seed)
    if a.out:
        with open(a.out, "w") as f:
            for p in probs:
                f.write(json.dumps(p) + "\n")
        print(f"wrote {len(probs)} problems to {a.out}")
    else:
        print("\n\n".join(format_example(p) for p in probs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

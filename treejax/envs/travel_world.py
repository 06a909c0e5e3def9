"""The travel-planning world's data and verifiers (DeepTravel, Ning et al. 2025, arXiv 2509.21842): a database of
cities, flights, trains and hotels generated from a seed, planning requests with hard constraints, and the two
verifiers of the hierarchical reward. The environment that answers tool calls from the database is
:mod:`treejax.envs.travel`; the task is :mod:`treejax.envs.travel_task`.

**The database** (:func:`generate_db`, deterministic from a seed, offline; the paper caches real transportation,
accommodation and POI data, this world generates it): ``NUM_CITIES`` made-up cities; for every ordered pair of
cities and every day ``1 .. NUM_DAYS``, 1-2 flights (``FL`` ids: 60-180 min, $80-$400) and 1-2 trains (``TR`` ids:
120-480 min, $30-$200), each departing between 06:00 and the time that lands it by 23:55; ``HOTELS_PER_CITY``
hotels per city (``HT`` ids: 2-5 stars, $40 + $25 per star + up to $60 a night). Ids are unique in the world.

**A request** (:func:`make_request`): from ``origin`` to ``dest``, out on day ``start``, back on day ``end``
(``end - start`` = 1 or 2 nights in a hotel in ``dest``), a ``budget`` and at most one more constraint: ``mode``
(both legs by train, or both by flight) or ``min_stars``. The reference plan is the cheapest one meeting the
constraints; the budget is its cost plus 0-15% slack, rounded up to $10, so a feasible plan always exists and a
random one usually costs too much.

**The plan** (the answer turn's last ``Answer:`` line, :func:`parse_plan`): ``go=<leg id>; back=<leg id>;
hotel=<hotel id>``.

**The trajectory-level verifier** (:func:`check_feasibility`, the paper's spatiotemporal feasibility check): the
plan parses; every id exists in the database; ``go`` leaves ``origin`` for ``dest`` on day ``start`` and ``back``
leaves ``dest`` for ``origin`` on day ``end``; the hotel is in ``dest``; ``mode`` and ``min_stars`` hold; the cost
``price(go) + price(back) + nights * price(hotel) <= budget``.

**The turn-level verifier** (:func:`check_consistency`, run only on feasible plans): each policy turn ``t`` (the
reasoning before a tool call, and the answer turn) may only state what the tool outputs before it showed. A
*claim* is an item id in a turn's text and the text after it up to the next id or the line's end; it agrees when
the id was listed in an output of an earlier turn and every ``$N`` in it equals the item's price and every
``HH:MM`` in it is the item's departure or arrival time. Every id of the plan is a claim of the answer turn, so a
plan must be built from items the agent saw. A turn without claims agrees.

**The hierarchical reward** (:func:`hierarchical_reward`)::

    r = 0                    the plan is infeasible (or missing); the turn-level verifier is not run
    r = c                    feasible, and some turn's claims disagree with the outputs it saw (c = inconsistent_credit)
    r = 1                    feasible and every turn consistent

Reconstructed (only the paper's abstract and secondary summaries were available): the database and its tools,
the request templates, the claim grammar (ids, prices, times), the rule-based turn verifier (the paper's turn-level
verifier is described only as validating the itinerary's details against the tool responses; here rules, not a
model) and the reward values (``c = 0`` by default: an itinerary the trajectory verifier passes but the turn
verifier rejects earns nothing, as a filter; ``c > 0`` grades it between).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Optional

import numpy as np

from treejax.errors import DataError

NUM_CITIES = 5
NUM_DAYS = 7
HOTELS_PER_CITY = 4
MODES = ("flight", "train")
#: Leg kinds by id prefix.
KIND_OF_PREFIX = {"FL": "flight", "TR": "train"}
_SYLLABLES = ("av", "el", "bor", "in", "cas", "ta", "dun", "mer", "fal", "os", "gri", "ven", "hal", "ur", "kes", "lo")
ITEM_ID = re.compile(r"\b(?:FL|TR|HT)\d{3}\b")
_PRICE = re.compile(r"\$\s?(\d+)")
_TIME = re.compile(r"\b(\d{1,2}):(\d{2})\b")
_PLAN_FIELD = re.compile(r"\b(go|back|hotel)\s*=\s*((?:FL|TR|HT)\d{3})\b", re.I)


@dataclasses.dataclass(frozen=True)
class Leg:
    """A flight or train: ``dep`` / ``arr`` in minutes after midnight of ``day``, ``price`` in dollars."""

    id: str
    kind: str
    origin: str
    dest: str
    day: int
    dep: int
    arr: int
    price: int


@dataclasses.dataclass(frozen=True)
class Hotel:
    id: str
    city: str
    stars: int
    price: int  # per night


@dataclasses.dataclass(frozen=True, eq=False)
class TravelDB:
    """A generated world: its ``cities`` and every leg and hotel by id."""

    seed: int
    cities: tuple[str, ...]
    legs: dict
    hotels: dict

    def find_legs(self, kind: str, origin: str, dest: str, day: int) -> list[Leg]:
        """The ``kind`` legs from ``origin`` to ``dest`` on ``day``, by departure time."""
        return sorted((g for g in self.legs.values() if (g.kind, g.origin, g.dest, g.day) == (kind, origin, dest, day)),
                      key=lambda g: (g.dep, g.id))

    def find_hotels(self, city: str) -> list[Hotel]:
        return sorted((h for h in self.hotels.values() if h.city == city), key=lambda h: h.id)


@dataclasses.dataclass(frozen=True)
class Request:
    """A planning request (module docstring): ``mode`` ``None`` or one of :data:`MODES`; ``min_stars`` 0: any."""

    origin: str
    dest: str
    start: int
    end: int
    budget: int
    mode: Optional[str] = None
    min_stars: int = 0

    @property
    def nights(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Plan:
    go: str
    back: str
    hotel: str

    def text(self) -> str:
        return f"go={self.go}; back={self.back}; hotel={self.hotel}"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the verifiers found: ``level`` one of ``"no_plan"``, ``"infeasible"``, ``"inconsistent"``, ``"ok"``;
    ``reason`` (one line); ``cost`` of a plan whose items exist; ``turn_consistent`` per policy turn (empty when the
    turn-level verifier did not run)."""

    level: str
    reason: str
    cost: Optional[int] = None
    turn_consistent: tuple[bool, ...] = ()

    @property
    def feasible(self) -> bool:
        return self.level in ("inconsistent", "ok")


def hhmm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def _city(rng: np.random.Generator, taken: set) -> str:
    while True:
        name = "".join(_SYLLABLES[int(rng.integers(len(_SYLLABLES)))] for _ in range(2)).capitalize()
        if name not in taken:
            return name


def _legs_of(rng, kind: str, origin: str, dest: str, day: int, next_id) -> list[Leg]:
    lo, hi, p_lo, p_hi = (60, 180, 80, 400) if kind == "flight" else (120, 480, 30, 200)
    out = []
    for _ in range(1 + int(rng.integers(2))):
        dur = 5 * int(rng.integers(lo // 5, hi // 5 + 1))
        dep = 5 * int(rng.integers(6 * 12, (23 * 60 + 55 - dur) // 5 + 1))
        out.append(Leg(next_id(kind), kind, origin, dest, day, dep, dep + dur, int(rng.integers(p_lo, p_hi + 1))))
    return out


@functools.lru_cache(maxsize=256)
def generate_db(seed: int) -> TravelDB:
    """The world of ``seed`` (module docstring); built once per seed."""
    rng = np.random.default_rng([seed, 7])
    cities: list[str] = []
    for _ in range(NUM_CITIES):
        cities.append(_city(rng, set(cities)))
    counts = {"flight": 0, "train": 0, "hotel": 0}
    prefix = {"flight": "FL", "train": "TR", "hotel": "HT"}

    def next_id(kind: str) -> str:
        counts[kind] += 1
        return f"{prefix[kind]}{counts[kind]:03d}"

    legs = {}
    for origin in cities:
        for dest in cities:
            if origin == dest:
                continue
            for day in range(1, NUM_DAYS + 1):
                for kind in MODES:
                    legs.update({g.id: g for g in _legs_of(rng, kind, origin, dest, day, next_id)})
    hotels = {}
    for city in cities:
        for _ in range(HOTELS_PER_CITY):
            stars = int(rng.integers(2, 6))
            h = Hotel(next_id("hotel"), city, stars, 40 + 25 * stars + int(rng.integers(0, 61)))
            hotels[h.id] = h
    return TravelDB(int(seed), tuple(cities), legs, hotels)


def plan_cost(db: TravelDB, plan: Plan, nights: int) -> int:
    return db.legs[plan.go].price + db.legs[plan.back].price + nights * db.hotels[plan.hotel].price


def cheapest_plan(db: TravelDB, req: Request) -> Optional[Plan]:
    """The cheapest plan meeting every constraint but the budget (ties by id), ``None`` when there is none."""
    kinds = (req.mode,) if req.mode else MODES
    go = [g for k in kinds for g in db.find_legs(k, req.origin, req.dest, req.start)]
    back = [g for k in kinds for g in db.find_legs(k, req.dest, req.origin, req.end)]
    hotels = [h for h in db.find_hotels(req.dest) if h.stars >= req.min_stars]
    if not (go and back and hotels):
        return None
    cheapest = lambda items: min(items, key=lambda x: (x.price, x.id)).id  # noqa: E731  each part on its own
    return Plan(cheapest(go), cheapest(back), cheapest(hotels))


def make_request(seed: int) -> tuple[Request, Plan]:
    """A request on the world of ``seed`` and its reference (cheapest) plan (module docstring)."""
    db, rng = generate_db(seed), np.random.default_rng([seed, 11])
    i, j = rng.choice(len(db.cities), size=2, replace=False)
    nights = 1 + int(rng.integers(2))
    start = 1 + int(rng.integers(NUM_DAYS - nights))
    kind = int(rng.integers(3))  # 0: budget only, 1: a mode, 2: a hotel class
    mode = MODES[int(rng.integers(2))] if kind == 1 else None
    dest = db.cities[int(j)]
    top = max(h.stars for h in db.find_hotels(dest))
    min_stars = min(int(rng.integers(3, 5)), top) if kind == 2 else 0
    req = Request(db.cities[int(i)], dest, start, start + nights, 0, mode, min_stars)
    plan = cheapest_plan(db, req)
    cost = plan_cost(db, plan, nights)
    budget = int(math.ceil(cost * (1.0 + 0.15 * float(rng.random())) / 10.0) * 10)
    return dataclasses.replace(req, budget=max(budget, cost)), plan


def describe(req: Request) -> str:
    """The request as the question text."""
    nights = f"{req.nights} night{'s' if req.nights > 1 else ''}"
    extra = (f" Travel by {req.mode} both ways." if req.mode else "") + (
        f" The hotel must have at least {req.min_stars} stars." if req.min_stars else "")
    return (f"Plan a trip from {req.origin} to {req.dest}: leave on day {req.start} and come back on day {req.end} "
            f"({nights} in a hotel in {req.dest}). The total cost (both tickets and every night) must be at most "
            f"${req.budget}.{extra}")


def parse_plan(text: str) -> Optional[Plan]:
    """The plan of the last ``Answer:`` line of ``text`` (``go=..; back=..; hotel=..``), ``None`` when it lacks a
    field."""
    hits = re.findall(r"answer\s*:\s*(.*)", text, flags=re.I)
    if not hits:
        return None
    fields = {k.lower(): v.upper() for k, v in _PLAN_FIELD.findall(hits[-1])}
    if set(fields) != {"go", "back", "hotel"}:
        return None
    return Plan(fields["go"], fields["back"], fields["hotel"])


def check_feasibility(plan: Optional[Plan], req: Request, db: TravelDB) -> Verdict:
    """The trajectory-level verifier (module docstring): ``Verdict("ok", ...)`` with the plan's cost when it meets
    every hard constraint, else ``"no_plan"`` / ``"infeasible"`` with the first failed check as ``reason``."""
    if plan is None:
        return Verdict("no_plan", "no 'Answer: go=..; back=..; hotel=..' line")
    for field, ids in (("go", db.legs), ("back", db.legs), ("hotel", db.hotels)):
        if getattr(plan, field) not in ids:
            return Verdict("infeasible", f"{field}: no item {getattr(plan, field)} in the database")
    go, back, hotel = db.legs[plan.go], db.legs[plan.back], db.hotels[plan.hotel]
    cost = plan_cost(db, plan, req.nights)
    checks = (
        ((go.origin, go.dest, go.day) == (req.origin, req.dest, req.start),
         f"go: {go.id} is {go.origin}->{go.dest} on day {go.day}, not {req.origin}->{req.dest} on day {req.start}"),
        ((back.origin, back.dest, back.day) == (req.dest, req.origin, req.end),
         f"back: {back.id} is {back.origin}->{back.dest} on day {back.day}, not {req.dest}->{req.origin} on day "
         f"{req.end}"),
        (hotel.city == req.dest, f"hotel: {hotel.id} is in {hotel.city}, not {req.dest}"),
        (req.mode is None or go.kind == back.kind == req.mode, f"mode: both legs must be by {req.mode}"),
        (hotel.stars >= req.min_stars, f"hotel: {hotel.id} has {hotel.stars} stars, fewer than {req.min_stars}"),
        (cost <= req.budget, f"budget: the plan costs ${cost}, over ${req.budget}"),
    )
    for ok, reason in checks:
        if not ok:
            return Verdict("infeasible", reason, cost)
    return Verdict("ok", "feasible", cost)


def claims(text: str) -> list[tuple[str, str]]:
    """``(id, segment)`` for every item id in ``text``: the segment is the text after the id up to the next id or
    the end of its line (module docstring)."""
    out = []
    for line in text.splitlines():
        hits = list(ITEM_ID.finditer(line))
        for k, m in enumerate(hits):
            end = hits[k + 1].start() if k + 1 < len(hits) else len(line)
            out.append((m.group(0), line[m.end():end]))
    return out


def claim_agrees(item_id: str, segment: str, shown: set, db: TravelDB) -> bool:
    """A claim agrees with the outputs seen: its id was ``shown`` and its prices and times are the item's."""
    if item_id not in shown:
        return False
    item = db.legs.get(item_id) or db.hotels.get(item_id)
    if item is None:
        return False
    times = {hhmm(item.dep), hhmm(item.arr)} if isinstance(item, Leg) else set()
    prices_ok = all(int(p) == item.price for p in _PRICE.findall(segment))
    times_ok = all(f"{int(h):02d}:{m}" in times for h, m in _TIME.findall(segment))
    return prices_ok and times_ok


def check_consistency(turns: tuple[str, ...], outputs: tuple[str, ...], db: TravelDB) -> tuple[bool, ...]:
    """The turn-level verifier (module docstring): per policy turn ``t``, whether each of its claims agrees with
    the tool outputs ``outputs[:t]`` of the turns before it (``outputs[k]``: the output the agent saw after turn
    ``k``)."""
    out = []
    for t, text in enumerate(turns):
        shown = {i for o in outputs[:t] for i in ITEM_ID.findall(o)}
        out.append(all(claim_agrees(i, seg, shown, db) for i, seg in claims(text)))
    return tuple(out)


def hierarchical_reward(turns: tuple[str, ...], outputs: tuple[str, ...], req: Request, db: TravelDB,
                        inconsistent_credit: float = 0.0) -> tuple[float, Verdict]:
    """``(r, verdict)`` of an episode whose last turn is the answer (module docstring): the trajectory-level
    verifier on the answer's plan, then, only when it passes, the turn-level verifier on every turn."""
    verdict = check_feasibility(parse_plan(turns[-1]) if turns else None, req, db)
    if not verdict.feasible:
        return 0.0, verdict
    turn_ok = check_consistency(turns, outputs, db)
    if all(turn_ok):
        return 1.0, dataclasses.replace(verdict, turn_consistent=turn_ok)
    bad = turn_ok.index(False) + 1
    return float(inconsistent_credit), Verdict("inconsistent", f"turn {bad} states what no earlier output showed",
                                               verdict.cost, turn_ok)


__all__ = ["HOTELS_PER_CITY", "Hotel", "ITEM_ID", "Leg", "MODES", "NUM_CITIES", "NUM_DAYS", "Plan", "Request",
           "TravelDB", "Verdict", "cheapest_plan", "check_consistency", "check_feasibility", "claim_agrees", "claims",
           "describe", "generate_db", "hhmm", "hierarchical_reward", "make_request", "parse_plan", "plan_cost"]

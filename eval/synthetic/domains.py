"""The domain catalogue of the synthetic market (all simulated).

Each :class:`Domain` says which argument keys identify an information need, how the need
reads in a user query, which entities it can be about, how its tools are named, and which
fields a (simulated) successful answer carries. The generator draws tasks from these; the
executor builds payloads from them. Argument keys are distinct across domains, so a
composite tool can take one flat argument dict for all the needs it covers.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DOMAINS", "DOMAIN_NAMES", "Domain"]

# A payload builder gets (rng, entity args) and returns the domain-specific fields.
PayloadBuilder = Callable[[random.Random, Mapping[str, str]], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Domain:
    """One information domain: keys, query phrasing, entities, tool names and payloads."""

    name: str
    arg_keys: tuple[str, ...]
    phrase: str  # how the need reads inside a query, e.g. "the weather in {city} {day}"
    description: str  # how the need is described, e.g. "weather forecast for {city} ({day})"
    entities: tuple[Mapping[str, str], ...]  # candidate canonical argument dicts
    action: str  # main tool verb, e.g. "forecast" -> weather_basic_forecast
    distractor_actions: tuple[str, ...]  # irrelevant functionality of the same domain
    payload: PayloadBuilder

    def render(self, template: str, args: Mapping[str, str]) -> str:
        return template.format(**args)


def _cross(key_a: str, values_a: tuple[str, ...], key_b: str, values_b: tuple[str, ...]) -> tuple[dict[str, str], ...]:
    return tuple({key_a: a, key_b: b} for a in values_a for b in values_b if a != b)


def _one(key: str, values: tuple[str, ...]) -> tuple[dict[str, str], ...]:
    return tuple({key: v} for v in values)


_CITIES = ("Oslo", "Lisbon", "Nairobi", "Osaka", "Denver", "Buenos Aires", "Hanoi", "Krakow", "Perth", "Montreal")
_DAYS = ("today", "tomorrow", "on Saturday", "this weekend")
_TICKERS = ("ACME", "GLOBX", "INITECH", "UMBRL", "WAYNE", "STARK", "HOOLI", "TYRELL", "CYBRD", "NKTMI")
_TOPICS = (
    "electric vehicles",
    "the central bank",
    "semiconductors",
    "the Olympics",
    "climate policy",
    "space launches",
    "vaccine research",
    "rail strikes",
)
_PLACES = (
    "Eiffel Tower",
    "Golden Gate Bridge",
    "Sydney Opera House",
    "Table Mountain",
    "Mount Fuji",
    "Machu Picchu",
    "Brandenburg Gate",
    "Petra",
)
_TEAMS = ("Arsenal", "Lakers", "Yankees", "Bayern Munich", "Maple Leafs", "Celtics", "Flamengo", "All Blacks")
_AIRPORTS = ("Lisbon", "Berlin", "Chicago", "Singapore", "Cairo", "Lima", "Seoul", "Toronto")
_CURRENCIES = ("USD", "EUR", "JPY", "GBP", "NOK", "CHF", "INR", "BRL")
_FILMS = ("Inception", "Parasite", "Arrival", "Spirited Away", "Amelie", "Heat", "Alien", "Roma")


def _weather(rng: random.Random, a: Mapping[str, str]) -> dict[str, Any]:
    return {
        "city": a.get("city", ""),
        "day": a.get("day", ""),
        "temperature_c": round(rng.uniform(-12, 36), 1),
        "condition": rng.choice(["sunny", "cloudy", "light rain", "showers", "snow", "fog", "windy"]),
        "precipitation_mm": round(rng.uniform(0, 18), 1),
        "wind_kph": rng.randint(0, 60),
    }


def _finance(rng: random.Random, a: Mapping[str, str]) -> dict[str, Any]:
    price = round(rng.uniform(4, 900), 2)
    return {
        "ticker": a.get("ticker", ""),
        "price": price,
        "currency": "USD",
        "change_pct": round(rng.uniform(-6, 6), 2),
        "volume": rng.randint(10_000, 40_000_000),
        "exchange": rng.choice(["NYSE", "NASDAQ"]),
    }


def _news(rng: random.Random, a: Mapping[str, str]) -> dict[str, Any]:
    topic = a.get("topic", "")
    outlets = ["Reuters", "AP", "The Ledger", "Daily Wire Service", "Global Times", "Metro Post"]
    return {
        "topic": topic,
        "articles": [
            {
                "headline": f"{rng.choice(['New', 'Fresh', 'Major', 'Unexpected'])} developments in {topic}",
                "outlet": rng.choice(outlets),
                "published_hours_ago": rng.randint(1, 48),
            }
            for _ in range(rng.randint(2, 3))
        ],
    }


def _geo(rng: random.Random, a: Mapping[str, str]) -> dict[str, Any]:
    return {
        "place": a.get("place", ""),
        "lat": round(rng.uniform(-60, 70), 5),
        "lon": round(rng.uniform(-180, 180), 5),
        "country_code": rng.choice(["FR", "US", "AU", "ZA", "JP", "PE", "DE", "JO"]),
    }


def _sports(rng: random.Random, a: Mapping[str, str]) -> dict[str, Any]:
    return {
        "team": a.get("team", ""),
        "opponent": rng.choice(["Rovers", "United", "City", "Athletic", "Wanderers"]),
        "score": f"{rng.randint(0, 5)}-{rng.randint(0, 5)}",
        "venue": rng.choice(["home", "away"]),
        "days_ago": rng.randint(1, 9),
    }


def _travel(rng: random.Random, a: Mapping[str, str]) -> dict[str, Any]:
    return {
        "origin": a.get("origin", ""),
        "destination": a.get("destination", ""),
        "cheapest_fare_usd": rng.randint(60, 1400),
        "airline": rng.choice(["SkyLark", "AeroNova", "BlueJet", "Polar Air"]),
        "stops": rng.randint(0, 2),
        "duration_h": round(rng.uniform(1, 22), 1),
    }


def _currency(rng: random.Random, a: Mapping[str, str]) -> dict[str, Any]:
    return {
        "base": a.get("base", ""),
        "quote": a.get("quote", ""),
        "rate": round(rng.uniform(0.005, 180), 5),
        "as_of": "latest close",
    }


def _movies(rng: random.Random, a: Mapping[str, str]) -> dict[str, Any]:
    return {
        "title": a.get("title", ""),
        "audience_score": rng.randint(40, 99),
        "critic_score": rng.randint(30, 100),
        "votes": rng.randint(1_000, 900_000),
    }


DOMAINS: Mapping[str, Domain] = {
    d.name: d
    for d in (
        Domain(
            "weather",
            ("city", "day"),
            "the weather in {city} {day}",
            "weather forecast for {city} ({day})",
            _cross("city", _CITIES, "day", _DAYS),
            "forecast",
            ("history", "air_quality", "pollen"),
            _weather,
        ),
        Domain(
            "finance",
            ("ticker",),
            "the stock price of {ticker}",
            "latest share price of {ticker}",
            _one("ticker", _TICKERS),
            "quote",
            ("filings", "company_profile", "dividends"),
            _finance,
        ),
        Domain(
            "news",
            ("topic",),
            "the latest news about {topic}",
            "recent headlines about {topic}",
            _one("topic", _TOPICS),
            "headlines",
            ("archive", "trending", "sentiment"),
            _news,
        ),
        Domain(
            "geo",
            ("place",),
            "the coordinates of {place}",
            "latitude and longitude of {place}",
            _one("place", _PLACES),
            "geocode",
            ("elevation", "timezone", "reverse_geocode"),
            _geo,
        ),
        Domain(
            "sports",
            ("team",),
            "the score of the last {team} game",
            "result of the most recent {team} match",
            _one("team", _TEAMS),
            "scores",
            ("standings", "roster", "injuries"),
            _sports,
        ),
        Domain(
            "travel",
            ("origin", "destination"),
            "the cheapest flight from {origin} to {destination}",
            "cheapest fare from {origin} to {destination}",
            _cross("origin", _AIRPORTS, "destination", _AIRPORTS),
            "flights",
            ("hotels", "car_rental", "visa_rules"),
            _travel,
        ),
        Domain(
            "currency",
            ("base", "quote"),
            "the exchange rate from {base} to {quote}",
            "exchange rate {base}/{quote}",
            _cross("base", _CURRENCIES, "quote", _CURRENCIES),
            "rates",
            ("history", "crypto", "inflation"),
            _currency,
        ),
        Domain(
            "movies",
            ("title",),
            "the audience rating of the film {title}",
            "audience rating of {title}",
            _one("title", _FILMS),
            "ratings",
            ("showtimes", "cast", "box_office"),
            _movies,
        ),
    )
}

DOMAIN_NAMES: tuple[str, ...] = tuple(DOMAINS)

# Sanity: argument keys must not collide across domains (composites take one flat dict).
_seen: dict[str, str] = {}
for _d in DOMAINS.values():
    for _k in _d.arg_keys:
        assert _k not in _seen, f"argument key {_k!r} is used by both {_seen[_k]} and {_d.name}"
        _seen[_k] = _d.name
del _seen

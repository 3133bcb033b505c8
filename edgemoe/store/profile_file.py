"""STORE/profile.json: the store's routing profile (edgemoe.scheduling.profile.RoutingProfile).

Sections: "routing" (RoutingProfile.to_json; its "temporal" part is optional, so profiles saved
before it existed still load) and "popularity" ({"<layer>": [fraction per expert]}, read for the
initial placement and the eviction prior), and "predictor" (optional: which of the correlation table
and the gate look-ahead predicted better when the store was profiled, edgemoe.scheduling.predictor_choice:
{"predictor": name, "precision": {name: precision at top-k}, "predictions": layers scored}; absent
from profiles made before it existed, or built from a trace, which has no hidden states for the
look-ahead). Other sections are preserved on save. Every write is atomic; a corrupt file is a
StoreError naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

from edgemoe.files import atomic_write
from edgemoe.scheduling.predictor_choice import PREDICTOR_CHOICES
from edgemoe.scheduling.profile import RoutingProfile

from .format import PROFILE, StoreError

Key = tuple[int, int]


def read_profile_file(store_dir) -> dict:
    """STORE/profile.json as a dict ({} when there is none)."""
    path = Path(store_dir) / PROFILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StoreError(f"{path}: corrupt profile ({exc})") from None
    if not isinstance(data, dict):
        raise StoreError(f"{path}: expected a JSON object")
    return data


def save_routing_profile(store_dir, profile: RoutingProfile, predictor: dict | None = None) -> Path:
    """Write the "routing", "popularity" and "predictor" sections of STORE/profile.json, keeping the
    others. predictor: the measured choice (compare_predictors), or None: none measured for this
    profile (an earlier one's is dropped: it measured another profile)."""
    path = Path(store_dir) / PROFILE
    data = read_profile_file(store_dir)
    data["routing"] = profile.to_json()
    data["popularity"] = {str(l): row for l, row in profile.popularity.items()}
    data.pop("predictor", None)
    if predictor is not None:
        data["predictor"] = predictor
    atomic_write(path, lambda f: json.dump(data, f))
    return path


def find_routing_profile(store_dir, data: dict | None = None) -> RoutingProfile | None:
    """The store's routing profile, or None without one (no profile.json, or no "routing" section).
    data: profile.json's contents when already read."""
    data = read_profile_file(store_dir) if data is None else data
    return _routing(Path(store_dir) / PROFILE, data["routing"]) if "routing" in data else None


def load_routing_profile(store_dir) -> RoutingProfile:
    """The store's routing profile; StoreError when it has none."""
    path = Path(store_dir) / PROFILE
    if not path.exists():
        raise StoreError(f"{path}: no profile (record a trace and save a RoutingProfile)")
    data = read_profile_file(store_dir)
    if "routing" not in data:
        raise StoreError(f"{path}: no 'routing' section")
    return _routing(path, data["routing"])


def read_popularity(store_dir, data: dict | None = None) -> dict[Key, float]:
    """profile.json's popularity by (layer, expert); {} without one. data: as find_routing_profile."""
    data = read_profile_file(store_dir) if data is None else data
    if "popularity" not in data:
        return {}
    try:
        return expert_popularity({int(l): row for l, row in data["popularity"].items()})
    except (AttributeError, TypeError, ValueError) as exc:
        raise StoreError(f"{Path(store_dir) / PROFILE}: malformed profile ({exc})") from None


def read_predictor_choice(store_dir, data: dict | None = None) -> str | None:
    """The predictor profiling measured better, or None when none was measured. data: as find_routing_profile."""
    data = read_profile_file(store_dir) if data is None else data
    section = data.get("predictor")
    if section is None:
        return None
    choice = section.get("predictor") if isinstance(section, dict) else None
    if choice not in PREDICTOR_CHOICES:
        raise StoreError(f"{Path(store_dir) / PROFILE}: malformed 'predictor' section: 'predictor' is {choice!r}, "
                         f"expected one of {', '.join(PREDICTOR_CHOICES)}")
    return choice


def expert_popularity(popularity: dict[int, list[float]]) -> dict[Key, float]:
    """{layer: [fraction per expert]} -> {(layer, expert): fraction}."""
    return {(int(l), e): float(p) for l, row in popularity.items() for e, p in enumerate(row)}


def _routing(path: Path, section) -> RoutingProfile:
    try:
        return RoutingProfile.from_json(section)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise StoreError(f"{path}: malformed 'routing' section ({exc})") from None

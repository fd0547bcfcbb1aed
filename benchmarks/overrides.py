"""`--set FIELD=VALUE` for the benchmarks: EngineConfig fields or ExecutionPlan overrides
(engine/plan.py) from the command line, for A/B runs."""

from __future__ import annotations

import dataclasses


def parse_value(text: str) -> object:
    """'true'/'false' -> bool, then int, then float, else the text itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def overrides(items: list[str]) -> dict[str, object]:
    """['a=1', 'b=true'] -> {'a': 1, 'b': True}."""
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--set wants FIELD=VALUE, got {item!r}")
        out[name] = parse_value(text)
    return out


def engine_config(fields: dict, plan: dict, items: list[str]):
    """An EngineConfig of `fields` with plan overrides `plan`; each `--set` item wins, as an
    EngineConfig field where one has its name, else as a plan override (checked there)."""
    from engine import EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig)}
    fields, plan = dict(fields), dict(plan)
    for name, value in overrides(items).items():
        (fields if name in names else plan)[name] = value
    return EngineConfig(**fields, plan_overrides=plan)

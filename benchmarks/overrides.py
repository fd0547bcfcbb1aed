"""`--set FIELD=VALUE` for the benchmarks: EngineConfig overrides from the command line."""

from __future__ import annotations


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

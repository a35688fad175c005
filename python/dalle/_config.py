"""Keyword arguments as the library's config assignments (key=value, the value in YAML)."""
import json


def assignments(overrides, prefix=""):
    """["key=value", ...] of a dict whose nested dicts are config sections:
    {"sampling": {"seed": 3}} and {"sampling.seed": 3} both give "sampling.seed=3"."""
    out = []
    for key, value in (overrides or {}).items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"config keys are non-empty strings, not {key!r}")
        if isinstance(value, dict):
            out += assignments(value, prefix + key + ".")
        elif value is None:
            raise ValueError(f"{prefix + key}: None is no config value (leave the key out for its default)")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")  # JSON is YAML's flow style
    return out

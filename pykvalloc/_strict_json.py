"""Values made ready for strict JSON, which has no NaN or infinity (strict parsers such as jq
refuse what Python's json writes for them by default)."""

from __future__ import annotations

import math
from typing import Any


def json_ready(value: Any) -> Any:
    """``value`` with every float that is not finite made None ("unknown"), through dicts,
    lists and tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    return value

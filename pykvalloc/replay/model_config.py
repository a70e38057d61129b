"""A model's KV geometry from its Hugging Face ``config.json``.

What is read, and what it means for the KV cache:

* ``num_hidden_layers``: the layers, every one of which keeps KV.
* DeepSeek-style multi-head latent attention (``kv_lora_rank`` set): one latent vector of
  ``kv_lora_rank + qk_rope_head_dim`` elements per token and layer, no K and V
  (``KVGroup.mla``).
* Otherwise K and V of ``num_key_value_heads`` heads (``num_attention_heads`` when absent, as
  transformers reads it) of ``head_dim`` elements, or ``hidden_size / num_attention_heads``
  when the config has no ``head_dim`` (a size that does not divide is refused).
* ``torch_dtype`` (or ``dtype``, its newer name): the element type, unless the caller names one.
* ``hidden_size``, when given: the model's width, which sizes the replay's activations.

A multimodal config keeps its language model's fields under ``text_config``, which is read
instead when the top level has no ``num_hidden_layers``. Anything missing or malformed raises
``InvalidArgument`` naming the file and the field; nothing is guessed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import InvalidArgument
from ..kvcache import KVGroup, dtype_bytes


class ModelGeometry(NamedTuple):
    groups: tuple[KVGroup, ...]
    dtype: str | None  # None when the config names none
    hidden_size: int | None = None  # the model's width (activations), when the config gives it


def _count(config: dict[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{where}: {key} must be a whole number of at least 1, not {value!r}")
    return value


def geometry_from_config(config: dict[str, Any], where: str = "the model config") -> ModelGeometry:
    """The KV groups and dtype of a parsed ``config.json`` (see the module docstring)."""
    if not isinstance(config, dict):
        raise InvalidArgument(f"{where}: not a JSON object")
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        return geometry_from_config(config["text_config"], f"{where} (text_config)")
    layers = _count(config, "num_hidden_layers", where)
    if config.get("kv_lora_rank") is not None:
        rank = _count(config, "kv_lora_rank", where)
        rope = _count(config, "qk_rope_head_dim", where)
        groups: tuple[KVGroup, ...] = (KVGroup.mla(layers, rank, rope),)
    else:
        heads = _count(config, "num_attention_heads", where)
        kv_heads = (_count(config, "num_key_value_heads", where)
                    if config.get("num_key_value_heads") is not None else heads)
        if config.get("head_dim") is not None:
            head_dim = _count(config, "head_dim", where)
        else:
            hidden = _count(config, "hidden_size", where)
            if hidden % heads:
                raise InvalidArgument(f"{where}: hidden_size {hidden} is not a multiple of "
                                      f"num_attention_heads {heads}, and there is no head_dim")
            head_dim = hidden // heads
        groups = (KVGroup(layers, kv_heads, head_dim),)
    dtype = config.get("torch_dtype", config.get("dtype"))
    if dtype is not None:
        if not isinstance(dtype, str):
            raise InvalidArgument(f"{where}: torch_dtype must be a name, not {dtype!r}")
        dtype_bytes(dtype)  # InvalidArgument naming the dtypes a KV cache knows
    width = config.get("hidden_size")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        width = None
    return ModelGeometry(groups, dtype, width)


def read_model_config(path: str | Path) -> ModelGeometry:
    """``geometry_from_config`` of the file at ``path``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgument(f"cannot read the model config {path}: {exc.strerror}") from None
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{path} is not JSON: {exc}") from None
    return geometry_from_config(config, str(path))

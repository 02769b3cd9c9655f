"""Configuration values that must reach their consumer exactly as the user wrote them.

LightningCLI parses the YAML file and the command line with jsonargparse, which reads a string again
as YAML wherever the type hint admits any value (``Any``): ``"####\\s*(.+)$"`` then becomes ``None``
(a YAML comment), ``"123"`` the int 123, ``"yes"`` True and ``"[ab]"`` a list. Free-form mappings
(reward ``args``, ``model_init_kwargs``, ``lora``) are therefore typed ``dict[str, AsWritten]``: the
YAML parser has already given each value its type (a quoted string stays a string, ``5`` is an int)
and jsonargparse leaves it alone.
"""

from __future__ import annotations

from jsonargparse.typing import register_type

__all__ = ["AsWritten"]


class AsWritten:
    """Type hint of a configuration value that is passed on as YAML/JSON wrote it (no second parse).

    Never instantiated: it only tells jsonargparse to keep the value (see the module doc).
    """


def _unchanged(value):
    return value


register_type(AsWritten, serializer=_unchanged, deserializer=_unchanged)

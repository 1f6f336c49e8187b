"""The engine's request errors, in a module of their own so sampling and the engine can share them."""
from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot take; the message names the field and the limit."""

"""Package logging: `SWIFTKV_LOGGING_LEVEL` (default INFO) controls the `swiftkv_fast` loggers."""

from __future__ import annotations

import logging

from swiftkv_fast import envs

_ROOT = "swiftkv_fast"
_configured = False


def _configure_root() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger(_ROOT)
    root.setLevel(envs.SWIFTKV_LOGGING_LEVEL.upper())
    if envs.SWIFTKV_CONFIGURE_LOGGING and not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s] %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.propagate = False


def init_logger(name: str) -> logging.Logger:
    _configure_root()
    return logging.getLogger(name)

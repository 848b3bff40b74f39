"""The framework-neutral engine (design layer 5): cadence, staging, routing, writing, signalling."""
from __future__ import annotations

from .cadence import Cadence
from .comm import Comm, GlooComm, LocalComm
from .metrics import PublishMetrics
from .publisher import PublishError, Publisher
from .signal import Signaller

__all__ = ["Cadence", "Comm", "GlooComm", "LocalComm", "PublishError", "PublishMetrics", "Publisher", "Signaller"]

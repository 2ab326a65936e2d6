"""The server's loaded model: what the routes read once loading is done (Server.ready)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the model load on the loader thread, after the port answers
    from moerun.engine.scheduler import EngineLoop, Scheduler
    from moerun.runtime import Runtime
    from moerun.text import ChatTemplate


@dataclass
class Ready:
    runtime: Runtime
    scheduler: Scheduler
    loop: EngineLoop
    template: ChatTemplate | None
    template_error: str | None

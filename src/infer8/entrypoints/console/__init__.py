"""The built-in web console: a chat playground at `/` and a live engine view at `/engine`."""

from __future__ import annotations

from infer8.entrypoints.console.recorder import StepRecorder
from infer8.entrypoints.console.routes import CONSOLE_PUBLIC_PATHS, add_console_routes

__all__ = ["CONSOLE_PUBLIC_PATHS", "StepRecorder", "add_console_routes"]

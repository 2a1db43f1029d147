"""An engine actor whose start never returns (a vLLM engine core stuck while it initializes): the
pool's start timeout must end it. It answers shutdown, as a real engine's actor does."""

from __future__ import annotations

import threading


class NeverStarts:
    def __init__(self, settings, buffer) -> None:
        self._stopped = threading.Event()

    def start(self, paused: bool) -> None:
        self._stopped.wait()  # until shutdown: what a start wedged in the engine core looks like from outside

    def shutdown(self) -> None:
        self._stopped.set()

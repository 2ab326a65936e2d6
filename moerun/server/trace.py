"""`moerun serve --trace-routing FILE`: one routing trace for the whole server (moerun/experts/trace.py).

Requests are numbered 0, 1, ... in the order they first run; every record carries its request's number and
its forward pass's `step`, so `moerun trace simulate` can replay a batched decode step as one cache step.
"""

from __future__ import annotations

from pathlib import Path
from weakref import WeakKeyDictionary

from moerun.experts.trace import RouteRecorder


class ServeRouteRecorder(RouteRecorder):
    """The model's `on_route` hook under continuous batching: the scheduler says whose rows a pass holds (one
    per request in a decode step, all of one request in a prompt chunk)."""

    def __init__(self, path: str | Path, spec, scheduler):
        super().__init__(path, spec)
        self.scheduler = scheduler
        self.numbers: WeakKeyDictionary = WeakKeyDictionary()  # request -> its number; gone with the request
        # self.request (RouteRecorder's request number) is the next request's number
        self.step, self._last_layer = -1, None

    def __call__(self, layer, phase, pos, ids, w):
        if self._last_layer is None or layer <= self._last_layer:  # the passes go through the layers in order
            self.step += 1
        self._last_layer = layer
        nums = [self._number(r) for r in self.scheduler.step_requests]
        if len(nums) != len(pos):
            nums = nums[:1] * len(pos)
        self.writer.write_step(layer=layer, phase=phase, request_ids=nums, positions=pos.tolist(),
                               experts=ids, weights=w, step=self.step)

    def _number(self, req) -> int:
        n = self.numbers.get(req)
        if n is None:
            n = self.numbers[req] = self.request
            self.request += 1
        return n

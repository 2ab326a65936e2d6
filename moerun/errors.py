"""Errors that reach the user as one clear line (the CLI prints them without a traceback)."""

from __future__ import annotations

from pathlib import Path


class MoerunError(Exception):
    """Base class for errors moerun reports to the user as a single line."""


class HostMemoryError(MoerunError, MemoryError):
    """The host could not give moerun the memory a model's weights need."""


class PeerLostError(MoerunError):
    """Another process of a model split over processes (a pipeline stage, an expert-parallel rank) crashed,
    stopped or did not answer in time: the model cannot run any more."""


class ModelOutputError(MoerunError):
    """The model computed logits a token cannot be chosen from (NaN): its weights are likely corrupt."""


NAN_LOGITS = ("the model's logits hold NaN (not a number), so no token can be chosen: its weights are likely "
              "corrupt or out of range for their type (check the file, e.g. against its published checksum)")


class ModelFormatError(MoerunError):
    """A model file is unreadable: truncated, corrupt, or of a kind moerun does not support."""

    def __init__(self, path: str | Path | None, problem: str):
        self.path = None if path is None else str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)

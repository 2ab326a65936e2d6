"""One call from a path to a runnable model: formats -> arch -> weights -> model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moerun.arch import Arch, resolve
from moerun.formats import open_model
from moerun.formats.records import ModelFile
from moerun.model.model import MoEModel
from moerun.weights.loader import load_weights


@dataclass
class Loaded:
    file: ModelFile
    arch: Arch
    model: MoEModel


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, kernels: bool = True) -> Loaded:
    """kernels=False runs quantized weights through the torch reference (dequantize per use)."""
    mf = open_model(path)
    arch = resolve(mf)
    return Loaded(mf, arch, MoEModel(arch.spec, load_weights(mf, arch), dtype=dtype, kernels=kernels))

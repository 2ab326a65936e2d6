"""moerun: run Mixture-of-Experts language models larger than your GPU."""

from moerun.errors import ModelFormatError, MoerunError

__version__ = "0.1.0"
__all__ = ["ModelFormatError", "MoerunError", "__version__"]

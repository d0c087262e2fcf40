"""aftgen: train causal Attention Free Transformer (AFT-local) language models and generate with constant memory."""

from aftgen.api import load
from aftgen.errors import AftgenError
from aftgen.model import AFTLM, AFTConfig

__all__ = ["AFTConfig", "AFTLM", "AftgenError", "load"]
__version__ = "0.1.0"

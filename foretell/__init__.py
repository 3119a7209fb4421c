"""foretell: an LLM inference engine built around exact speculative decoding."""

from foretell.config import SpeculativeConfig
from foretell.engine.llm import LLM
from foretell.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig"]
__version__ = "0.1.0"

"""rlinf_twoworker: GRPO training across several Ray nodes, as one library call."""

from rlinf_twoworker.config import GRPOConfig, load_config

__all__ = ["GRPOConfig", "load_config"]
__version__ = "0.1.0"

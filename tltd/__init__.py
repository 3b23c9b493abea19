"""tltd: a node daemon serving LLM rollouts to RL trainers with adaptive speculative decoding."""

__version__ = "0.1.0"

"""The DeepSeek-V2/V3 MoE model and expert parallelism."""

from moe.config import ModelConfig
from moe.loader import load_model, resolve_model_path
from moe.model import DeepseekForCausalLM

__all__ = ["DeepseekForCausalLM", "ModelConfig", "load_model", "resolve_model_path"]

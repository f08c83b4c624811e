"""What one rank runs, without Ray: requests, sampling, the paged latent KV cache, the block
manager, the scheduler, the model runner, and the in-process LLM API."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.messages import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]

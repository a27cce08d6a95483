"""dspark: DSpark speculative decoding in PyTorch."""
from dspark.llm import LLM
from dspark.outputs import RequestOutput
from dspark.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

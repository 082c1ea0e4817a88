"""Text generation over GPTModel: slotted KV cache, continuous batching, sampling, decode CUDA graphs."""
from .contexts import StaticInferenceContext
from .engine import InferenceEngine
from .inference_request import InferenceRequest, Status
from .sampling_params import SamplingParams

__all__ = ["StaticInferenceContext", "InferenceEngine", "InferenceRequest", "Status", "SamplingParams"]

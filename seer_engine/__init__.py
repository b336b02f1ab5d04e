"""seer_engine: an LLM inference engine for the rollout phase of synchronous RL."""

from seer_engine.outputs import CompletionOutput, Logprob, RequestOutput
from seer_engine.sampling_params import InvalidRequestError, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "InvalidRequestError",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str):
    # Importing the engine pulls in torch/transformers; keep `import seer_engine` light.
    if name == "LLM":
        from seer_engine.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)

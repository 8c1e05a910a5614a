"""The control plane: requests, scheduling, the engine loop and the public API. Never imports torch."""

from nanoplane.controlplane.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM wires in an in-process data plane (torch); import it only when asked for.
    if name == "LLM":
        from nanoplane.controlplane.llm import LLM

        return LLM
    raise AttributeError(name)

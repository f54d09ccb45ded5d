"""jaxserve: an LLM serving engine on JAX. `from jaxserve import LLM, SamplingParams`."""

from jaxserve.sampling_params import SamplingParams


def __getattr__(name: str):
    # LLM pulls in JAX and the model; import it only when asked for.
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]

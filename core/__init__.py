"""ifb: an LLM serving engine with in-flight batching and plugin-supplied models."""

from ifb.hookspecs import hookimpl
from ifb.params import InvalidRequest, RequestSpec, SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in the engine; keep `import ifb` light for plugins that only need hookimpl.
    if name == "LLM":
        from ifb.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestSpec", "InvalidRequest", "hookimpl", "__version__"]

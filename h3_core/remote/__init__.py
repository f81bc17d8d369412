"""Generation on a remote server: the OpenAI-style videos API of SGLang diffusion (or vLLM-Omni) running H3 across
GPUs, behind the same `generate` as `H3Pipeline`. The protocol's facts live in `protocol.py` only."""

from .remote_engine import RemoteEngine

__all__ = ["RemoteEngine"]

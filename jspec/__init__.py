"""jspec: speculative decoding for Qwen2-family models as one compiled JAX program.

    bundle = jspec.load("qwen2.5-coder")
    result = jspec.generate(bundle, "def quicksort(arr):")
"""

from jspec.api import Bundle, Model, Result, check_pair, generate, stream

__all__ = ["Bundle", "Model", "Result", "check_pair", "generate", "stream"]

from jspec.loading import load  # noqa: E402  (api must be importable first)

__all__ += ["load"]

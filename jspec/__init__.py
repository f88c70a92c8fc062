"""jspec: speculative decoding for Qwen2-family models as one compiled JAX program.

    bundle = jspec.load("qwen2.5-coder")
    result = jspec.generate(bundle, "def quicksort(arr):")
"""

from jspec.api import Result, generate, stream
from jspec.bundle import Bundle, Model, Settings, check_pair
from jspec.distill import distill  # issue 35 (the module: importlib.import_module("jspec.distill"))
from jspec.options import Options
from jspec.loading import load
from jspec.mesh import shard  # issue 34: a bundle on a jax.sharding mesh

__all__ = ["Bundle", "Model", "Options", "Result", "Settings", "check_pair", "distill",
           "generate", "load", "shard", "stream"]

"""dalle: the DALL-E framework's C++ library from Python.

Generation, training, the capacity planner and the prior, in the same process as torch and
sharing its tensors (one libtorch: no copy at the boundary). docs/python.md has the whole API.

    import dalle
    pipeline = dalle.Pipeline("models/fashion-compose", candidates=16)
    images = pipeline.generate("a red bag on the left", n=2, seed=7)
    images[0].image.save("bag.png")   # a PIL image; .png holds dalle-generate's file, byte for byte

Errors are dalle.Error (a RuntimeError) with the library's message, dalle.ConfigError (also a
ValueError) for a bad config key or value, ValueError for a bad argument.
"""
import torch  # noqa: F401  (first: the extension module is linked to the libtorch torch loaded)

from ._dalle import ConfigError, Error
from ._pipeline import Image, Pipeline, Preview
from ._planning import plan
from ._prior import Prior, load_prior
from ._training import train

__all__ = ["ConfigError", "Error", "Image", "Pipeline", "Preview", "Prior", "load_prior", "plan", "train"]

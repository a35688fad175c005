"""dalle.load_prior: a trained prior whose forward takes and returns torch tensors."""
from . import _dalle


class Prior:
    """A trained sparse transformer prior. prior(tokens) (or forward) maps [B, text + image]
    int64 tokens to logits; its parameters are the model's own tensors (no copy), so autograd
    and torch.no_grad() apply as to any torch module. config is its PriorConfig as a dict."""

    def __init__(self, loaded):
        self._prior = loaded
        self.config = dict(loaded.config)
        self.tokenizer, self.image_tokenizer, self.checkpoint = (loaded.tokenizer, loaded.image_tokenizer,
                                                                 loaded.checkpoint)

    def forward(self, tokens):
        return self._prior.forward(tokens)

    __call__ = forward

    def named_parameters(self):
        return dict(self._prior.named_parameters())

    def to(self, device):
        self._prior.to(str(device))
        return self

    def train(self, mode=True):
        self._prior.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def __repr__(self):
        return f"<dalle.Prior {self.checkpoint!r} layers={self.config.get('layers')} width={self.config.get('width')}>"


def load_prior(path, dtype="float32"):
    """The prior of a run directory or checkpoint, its weights in `dtype` (float32, bfloat16 or
    float16), in eval mode."""
    return Prior(_dalle.load_prior(str(path), dtype))

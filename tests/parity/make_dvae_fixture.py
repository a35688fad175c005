"""Parity fixture for the dVAE: OpenAI's `dall_e` Encoder and Decoder (PyPI `dall-e` 0.1)
built with random weights at a small size, their state dicts, an input and the outputs,
saved as tests/fixtures/dvae_parity.safetensors. The C++ test loads the weights by name and
must reproduce the outputs to 1e-4 relative error.

The package needs `attrs` and `requests`, which it does not declare, and torch; e.g.
    python3 -m venv refs && refs/bin/pip install --no-deps dall-e==0.1 attrs requests \
        urllib3 idna certifi charset-normalizer   (torch from ~/.cache/dalle/venv via a .pth)
    refs/bin/python tests/parity/make_dvae_fixture.py
"""
import pathlib

import attr
import torch
from dall_e import Decoder, Encoder, map_pixels
from safetensors.torch import save_file

SIZES = dict(n_hid=16, n_blk_per_group=2, vocab_size=64)
N_INIT = 8

torch.manual_seed(0)
# The package's validators demand production sizes (n_hid >= 64, vocab >= 512); the layout
# does not depend on them, so they are switched off to keep the fixture small.
attr.set_run_validators(False)
encoder = Encoder(**SIZES, device=torch.device("cpu"), requires_grad=False)
decoder = Decoder(**SIZES, n_init=N_INIT, device=torch.device("cpu"), requires_grad=False)
attr.set_run_validators(True)
with torch.no_grad():
    for p in list(encoder.parameters()) + list(decoder.parameters()):
        p.normal_(0.0, 0.5 / max(1, p[0].numel()) ** 0.5 if p.dim() > 1 else 0.1)

pixels = torch.rand(2, 3, 32, 32)
with torch.no_grad():
    logits = encoder(map_pixels(pixels))
    codes = torch.softmax(torch.randn(2, SIZES["vocab_size"], 4, 4) * 3, dim=1)
    output = decoder(codes)

tensors = {f"encoder.{k}": v for k, v in encoder.state_dict().items()}
tensors |= {f"decoder.{k}": v for k, v in decoder.state_dict().items()}
tensors |= {"pixels": pixels, "logits": logits, "codes": codes, "output": output}
out = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "dvae_parity.safetensors"
metadata = {"hidden": "16", "blocks_per_group": "2", "vocab_size": "64", "decoder_init": str(N_INIT),
            "groups": "4", "downsamplings": "3", "generator": "dall-e 0.1, torch " + torch.__version__}
save_file({k: v.contiguous() for k, v in tensors.items()}, str(out), metadata=metadata)
print(f"wrote {out} ({out.stat().st_size} bytes, {len(tensors)} tensors)")

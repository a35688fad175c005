"""Random weights a parity fixture stores small: shared by make_clip_fixture.py and
make_ruclip_fixture.py, whose models name their tensors alike (OpenAI CLIP's names)."""
import torch


def quantized_randomize(module, generator):
    """Gives every parameter random values q * 2^-e with |q| <= 127; returns q and e by name.
    LayerNorm gains sit in [0.5, 1) and biases within +-0.25; matrices are about
    N(0, 1/fan_in), where fan_in is the input width (rows for the x @ proj projections)."""
    stored = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.split(".")[-2:-1] and name.split(".")[-2].startswith("ln_") and name.endswith(".weight"):
                q, e = torch.randint(64, 128, p.shape, generator=generator), 7
            elif name == "logit_scale":
                q, e = torch.tensor(85), 5  # 2.656, about ln(1 / 0.07)
            elif p.dim() == 1:
                q, e = torch.randint(-127, 128, p.shape, generator=generator), 9
            else:
                fan_in = p.shape[0] if name in ("visual.proj", "text_projection") else p[0].numel()
                e = max(0, round(torch.log2(torch.tensor(127.0 * fan_in ** 0.5 / 3 ** 0.5)).item()))
                q = torch.randint(-127, 128, p.shape, generator=generator)
            p.copy_(q.float() * 2.0 ** -e)
            stored[name] = q.to(torch.int8)
            stored[name + ":scale"] = torch.tensor(2.0 ** -e, dtype=torch.float32)
    return stored

"""Trains the reference `dall_e` 0.1 Encoder/Decoder with the tiny recipe of
configs/dvae/fashion-compose-tiny.yaml (logit-Laplace, KL 0 -> 6.6 over 500 updates, tau 1 -> 1/16
over 2000, AdamW, batch 16) on demo/fashion-compose, to check whether the codebook collapse
seen with the C++ trainer (docs/dvae.md) is the recipe's or ours. Needs the reference venv of
make_dvae_fixture.py plus pillow; argument: the learning rate (default 1e-3).
"""
import json, math, random, sys
import numpy as np, torch
from PIL import Image
import attr
from dall_e import Encoder, Decoder
attr.set_run_validators(False)
torch.set_num_threads(1)
torch.manual_seed(0)
root = "/work/main/demo/fashion-compose/"
def load(split, n):
    recs = [json.loads(l) for l in open(root + split + "/captions.jsonl")][:n]
    return torch.stack([torch.from_numpy(np.asarray(Image.open(root + split + "/" + r["image"]).convert("RGB"), dtype=np.float32) / 255).permute(2, 0, 1) for r in recs])
train, val = load("train", 4000), load("test", 256)
enc = Encoder(n_hid=32, n_blk_per_group=1, input_channels=3, vocab_size=512, device=torch.device("cpu"), requires_grad=False, use_mixed_precision=False)
dec = Decoder(n_init=32, n_hid=32, n_blk_per_group=1, output_channels=3, vocab_size=512, device=torch.device("cpu"), requires_grad=False, use_mixed_precision=False)
params = list(enc.parameters()) + list(dec.parameters())
for p_ in params: p_.requires_grad_(True)
opt = torch.optim.AdamW(params, lr=float(sys.argv[1]) if len(sys.argv) > 1 else 1e-3, weight_decay=1e-4)
eps = 0.1
mp = lambda x: (1 - 2 * eps) * x + eps
steps = 300
for step in range(1, steps + 1):
    idx = torch.randint(0, len(train), (16,))
    x = mp(train[idx])
    tau = 1.0 / 16 + 0.5 * (1 - 1.0 / 16) * (1 + math.cos(math.pi * min(step / 2000, 1)))
    klw = 6.6 * 0.5 * (1 - math.cos(math.pi * min(step / 500, 1)))
    logits = enc(x)
    g = -torch.log(-torch.log(torch.rand_like(logits).clamp(1e-10, 1 - 1e-7)))
    z = torch.softmax((logits + g) / tau, 1)
    out = dec(z).float()
    mu, lnb = out[:, :3], out[:, 3:]
    lx = torch.log(x) - torch.log1p(-x)
    nll = ((lx - mu).abs() * torch.exp(-lnb) + lnb + math.log(2) + torch.log(x) + torch.log1p(-x)).mean()
    lq = torch.log_softmax(logits, 1)
    kl = (lq.exp() * (lq + math.log(512))).sum(1).mean()
    loss = nll + klw * kl / 192
    opt.zero_grad(); loss.backward(); opt.step()
    if step % 100 == 0:
        with torch.no_grad():
            codes = enc(mp(val)).argmax(1)
            rec = (torch.sigmoid(dec(torch.nn.functional.one_hot(codes, 512).permute(0, 3, 1, 2).float())[:, :3]) - eps) / (1 - 2 * eps)
            psnr = (-10 * torch.log10(((rec.clamp(0, 1) - val) ** 2).flatten(1).mean(1))).mean().item()
            cnt = torch.bincount(codes.flatten(), minlength=512).float(); p = cnt / cnt.sum()
            ppl = math.exp(-(p[p > 0] * p[p > 0].log()).sum().item())
        print(f"step {step} loss {loss.item():.3f} psnr {psnr:.2f} perplexity {ppl:.2f} used {(cnt > 0).float().mean().item():.3f}", flush=True)

"""Parity fixtures for ruDALL-E's transformer prior (PyPI `rudalle` 1.1.3).

Writes two files:

* tests/fixtures/rudalle_prior_parity.safetensors: ruDALL-E's DalleModel, built by the
  package's own `get_rudalle_model('dummy', pretrained=False, ...)` at a small size with
  random weights (LayerNorm gains and biases perturbed away from 1 and 0), in eval mode,
  fp32, CPU; its full state dict (`state.<name>`, the package's own names, including the
  three bool mask buffers), the input ids (`input.ids`, raw tokenizer-style ids with 0 as
  padding), the 0/1 attention mask passed to the model (`input.attention_mask`, the
  lower-triangular one of rudalle.pipelines), the logits (`output.logits`), the loss and its
  two parts (`output.loss`, `output.loss_text`, `output.loss_image`), the mask each layer
  actually multiplies its scores with (`mask.layer_N`, uint8 0/1, [L, L]), the embeddings
  fed to the transformer and every layer's output (`act.*`, for debugging), and a KV-cached
  incremental decode (`cache.*`, see below).
* tests/fixtures/rudalle_masks.safetensors: the package's mask helpers
  (rudalle/dalle/image_attention.py) for 6 text tokens and a 4x4 grid (row, column, conv
  kernel 3 in the wrap-around v2 and clamped v3 variants, conv kernel 11 as the model
  builds it), and for 6 text tokens and an 8x8 grid (where kernel 11 is not trivial),
  all uint8 0/1 [L, L] with mask[query, key].

KV cache (`cache.*`): the model is first called with use_cache=True, cache=None on the
first `cache.prefix_len` tokens (text + 5 image tokens); `cache.prefix_logits` holds those
logits (== the uncached logits of the prefix). Then it is called again and again with the
whole sequence so far and the cache, adding 1, 3, 1, 2, 1, 1, 1, 1 new tokens per call
(ruDALL-E's image prompts append several tokens between calls); `cache.step_ends[c]` is
the sequence length passed to call c. Only the rows of the tokens that are new in a call
are valid; they are concatenated in `cache.step_logits` [B, L - prefix_len, vocab] and
equal `output.logits[:, prefix_len:]`. ruDALL-E's cached calls return garbage for the
older rows (see docs/rudalle-prior.md); `cache.step_logits_rows_before_last_match` is 0
to record that they do not match and are not meant to be compared.

The script also re-implements the forward pass, loss and masks from scratch as
docs/rudalle-prior.md specifies them and asserts they match the package, so the document
is checked against the code.

`import rudalle` needs huggingface_hub.cached_download and transformers (both long gone
from current releases), so rudalle/__init__.py is not executed: a stub `rudalle` package
(with __path__ set) is registered in sys.modules, then rudalle/dalle/__init__.py, which
holds get_rudalle_model and MODELS, is imported for real with `huggingface_hub` and `tqdm`
stubbed where missing (they are only used for pretrained downloads).

Environment (no network needed at run time; torch, numpy and safetensors come from the
project venv ~/.cache/dalle/venv through a .pth file; nothing else is needed):
    python3 -m venv ~/.cache/dalle/rudalle-venv
    ~/.cache/dalle/rudalle-venv/bin/pip install --no-deps rudalle==1.1.3 einops==0.3.2
    echo ~/.cache/dalle/venv/lib/python3.11/site-packages \
        > ~/.cache/dalle/rudalle-venv/lib/python3.11/site-packages/dalle-torch.pth
    ~/.cache/dalle/rudalle-venv/bin/python tests/parity/make_rudalle_prior_fixture.py
It runs in ~15 s on one CPU core and writes byte-identical files on every run.
"""
import importlib
import json
import math
import pathlib
import sys
import types

import torch
import torch.nn.functional as F
from safetensors.torch import save_file


# ---------------------------------------------------------------------------------------
# Import rudalle.dalle without rudalle/__init__.py
# ---------------------------------------------------------------------------------------
def import_rudalle_dalle():
    spec = importlib.util.find_spec("rudalle")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("rudalle is not installed in this interpreter (see the docstring)")
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
    pkg = types.ModuleType("rudalle")
    pkg.__path__ = [str(root)]
    sys.modules["rudalle"] = pkg
    for name in ("huggingface_hub", "tqdm", "tqdm.auto"):
        try:
            importlib.import_module(name)
        except ImportError:
            stub = types.ModuleType(name)
            if name == "huggingface_hub":
                def _offline(*args, **kwargs):
                    raise RuntimeError("stubbed: no downloads in fixture generation")
                stub.hf_hub_url = stub.cached_download = _offline
            else:
                stub.__path__ = []
                stub.tqdm = lambda *a, **k: None
                stub.auto = stub
            sys.modules[name] = stub
    # rudalle/dalle/__init__.py only needs torch, huggingface_hub and tqdm: execute it so
    # that get_rudalle_model and MODELS are the package's own.
    dalle = importlib.import_module("rudalle.dalle")
    ia = importlib.import_module("rudalle.dalle.image_attention")
    return dalle, ia, root


dalle_pkg, image_attention, RUDALLE_ROOT = import_rudalle_dalle()
from rudalle.dalle.model import DalleModel  # noqa: E402

# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------
TEXT_VOCAB = 32          # "BPE" vocabulary; ruDALL-E: 16384
T = 8                    # text_seq_length; ruDALL-E: 128
W = 4                    # image_tokens_per_dim; ruDALL-E: 32
N = W * W                # image tokens
IMAGE_VOCAB = 16         # ruDALL-E: 8192
LAYERS, HIDDEN, HEADS = 4, 64, 4
V = TEXT_VOCAB + T       # vocab_size passed to the model, as ruDALL-E does (16384 + 128)
L = T + N
BATCH = 2

torch.manual_seed(0)
model = dalle_pkg.get_rudalle_model(
    "dummy", pretrained=False, fp16=False, device="cpu",
    num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
    text_seq_length=T, image_tokens_per_dim=W, vocab_size=V, image_vocab_size=IMAGE_VOCAB)
assert type(model) is DalleModel and model.hf_version == "v3"
model.eval()

with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "to_logits.0.weight":
            p.copy_(1.0 + 0.25 * torch.randn_like(p))
        elif name.endswith("layernorm.bias") or name == "to_logits.0.bias":
            p.copy_(0.2 * torch.randn_like(p))
        elif "embeddings" in name:
            p.normal_(0.0, 0.5)
        elif name.endswith("query_key_value.weight"):
            p.normal_(0.0, 0.12)   # large enough that attention is far from uniform
        elif name.endswith(".weight"):
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
        else:
            p.normal_(0.0, 0.05)

# ---------------------------------------------------------------------------------------
# Inputs: the tokenizer's layout [BOS=2, tokens..., EOS=3, 0, 0, ...] (pad id 0; the model
# replaces each 0 in the text part by the position-unique id V - T + position).
# ---------------------------------------------------------------------------------------
g = torch.Generator().manual_seed(1)
texts = [
    [2] + torch.randint(4, TEXT_VOCAB, (4,), generator=g).tolist() + [3],   # 2 pads
    [2] + torch.randint(4, TEXT_VOCAB, (1,), generator=g).tolist() + [3],   # 5 pads
]
text_ids = torch.tensor([t + [0] * (T - len(t)) for t in texts], dtype=torch.long)
image_ids = torch.randint(0, IMAGE_VOCAB, (BATCH, N), generator=g)
ids = torch.cat([text_ids, image_ids], dim=1)
attention_mask = torch.tril(torch.ones(BATCH, 1, L, L))   # as rudalle.pipelines builds it

# Capture the mask each layer receives (attention_mask * layer mask) and every layer output.
seen_masks, layer_outputs = {}, {}
hooks = []
for i, layer in enumerate(model.transformer.layers):
    hooks.append(layer.register_forward_pre_hook(
        lambda mod, args, kw=None, i=i: seen_masks.__setitem__(i, args[1].detach().clone())))
    hooks.append(layer.register_forward_hook(
        lambda mod, args, out, i=i: layer_outputs.__setitem__(i, out[0].detach().clone())))
transformer_inputs = {}
hooks.append(model.transformer.register_forward_pre_hook(
    lambda mod, args: transformer_inputs.__setitem__("x", args[0].detach().clone())))
hooks.append(model.transformer.register_forward_hook(
    lambda mod, args, out: transformer_inputs.__setitem__("out", out[0].detach().clone())))

with torch.no_grad():
    logits, _ = model(ids, attention_mask, return_loss=False)
    embeddings = transformer_inputs["x"]
    final_ln = transformer_inputs["out"]
    masks = {i: seen_masks[i] for i in range(LAYERS)}
    outs = {i: layer_outputs[i] for i in range(LAYERS)}
    logits_again, _ = model(ids, attention_mask, return_loss=False)
    loss, parts = model(ids, attention_mask, return_loss=True)
    loss_again, _ = model(ids, attention_mask, return_loss=True)
for h in hooks:
    h.remove()
assert torch.equal(logits, logits_again), "logits are not reproducible"
assert torch.equal(loss, loss_again), "loss is not reproducible"
assert logits.shape == (BATCH, L, V + IMAGE_VOCAB)

layer_masks = {}
for i, m in masks.items():
    assert m.shape == (BATCH, 1, L, L)
    assert torch.equal(m[0], m[1])
    assert bool(((m == 0) | (m == 1)).all())
    layer_masks[i] = m[0, 0].to(torch.uint8)

# ---------------------------------------------------------------------------------------
# KV cache: prefix call, then one call per token with the growing sequence.
# ---------------------------------------------------------------------------------------
PREFIX = T + 5
STEPS = [1, 3, 1, 2, 1, 1, 1, 1]   # new tokens per cached call (image prompts add several)
assert PREFIX + sum(STEPS) == L
with torch.no_grad():
    prefix_logits, cache = model(ids[:, :PREFIX], attention_mask, use_cache=True, cache=None)
    cache_layout = {i: [tuple(t.shape) for t in c] for i, c in cache.items()}
    step_logits, step_ends, older_rows_match, n = [], [], True, PREFIX
    for step in STEPS:
        n += step
        out, cache = model(ids[:, :n], attention_mask, use_cache=True, cache=cache)
        assert out.shape == (BATCH, n, V + IMAGE_VOCAB)
        step_logits.append(out[:, -step:])
        step_ends.append(n)
        older_rows_match &= torch.allclose(out[:, :-step], logits[:, :n - step], atol=1e-4)
    step_logits = torch.cat(step_logits, dim=1)
    cache_layout_final = {i: [tuple(t.shape) for t in c] for i, c in cache.items()}
cache_err = (step_logits - logits[:, PREFIX:]).abs().max().item()
prefix_err = (prefix_logits - logits[:, :PREFIX]).abs().max().item()
assert cache_err < 1e-4 and prefix_err < 1e-4, (cache_err, prefix_err)


# ---------------------------------------------------------------------------------------
# Independent re-implementation of docs/rudalle-prior.md, checked against the package.
# ---------------------------------------------------------------------------------------
def spec_layer_kind(i, num_layers):
    if (i - 1) % 4 == 0:          # Python %: (-1) % 4 == 3, so layer 0 is never column
        return "col"
    return "row" if i != num_layers - 1 else "conv"


def spec_mask(kind, text, w, kernel=11, version="v3"):
    n_all = text + w * w
    m = torch.zeros(n_all, n_all, dtype=torch.bool)
    for q in range(n_all):
        for k in range(q + 1):     # causal everywhere: key k <= query q
            if q < text or k < text:
                m[q, k] = True     # text keys: all visible (causally); text queries: causal
                continue
            a, b = q - text, k - text
            if kind == "row":
                ok = a - b <= w
            elif kind == "col":
                ok = (a - b) % w == 0
            else:
                s = kernel // 2
                dr, dc = a // w - b // w, a % w - b % w
                if version == "v3":
                    ok = abs(dr) <= s and abs(dc) <= s
                else:  # v2: circular distance on the torus
                    ok = min(dr % w, -dr % w) <= s and min(dc % w, -dc % w) <= s
                ok = ok or a == b
            m[q, k] = ok
    return m


def spec_forward(sd, ids, text_len, w, vocab, heads, num_layers, eps=1e-5, mask=None):
    b, n = ids.shape
    text = ids[:, :text_len]
    pos = torch.arange(text_len)
    text = torch.where(text == 0, vocab - text_len + pos, text)
    x = sd["text_embeddings.weight"][text] + sd["text_pos_embeddings.weight"][pos]
    img = ids[:, text_len:]
    if img.shape[1] > 0:
        k = torch.arange(img.shape[1])
        xi = (sd["image_embeddings.weight"][img] + sd["image_row_embeddings.weight"][k // w]
              + sd["image_col_embeddings.weight"][k % w])
        x = torch.cat([x, xi], dim=1)
    d = x.shape[-1]
    hd = d // heads

    def ln(t, p):
        return F.layer_norm(t, (d,), sd[p + ".weight"], sd[p + ".bias"], eps)

    def lin(t, p):
        return t @ sd[p + ".weight"].T + sd[p + ".bias"]

    for i in range(num_layers):
        p = f"transformer.layers.{i}."
        m = spec_mask(spec_layer_kind(i, num_layers), text_len, w)[:n, :n].float()
        if mask is not None:
            m = m * mask
        h = ln(x, p + "input_layernorm")
        qkv = lin(h, p + "attention.query_key_value")
        q, kk, v = [t.view(b, n, heads, hd).permute(0, 2, 1, 3) for t in qkv.split(d, dim=-1)]
        s = (q / math.sqrt(hd)) @ kk.transpose(-1, -2)
        s = s * m - 10000.0 * (1.0 - m)
        s = s / 32
        s = (s - s.amax(dim=(-1, -2), keepdim=True)) * 32
        a = torch.softmax(s, dim=-1) @ v
        a = a.permute(0, 2, 1, 3).reshape(b, n, d)
        a = lin(a, p + "attention.dense").clamp(-65504, 65504)
        x = x + ln(a, p + "before_first_addition_layernorm")
        h = ln(x, p + "post_attention_layernorm")
        u = lin(h, p + "mlp.dense_h_to_4h")
        u = 0.5 * u * (1.0 + torch.tanh(0.7978845608028654 * u * (1.0 + 0.044715 * u * u)))
        x = x + ln(lin(u, p + "mlp.dense_4h_to_h"), p + "before_second_addition_layernorm")
    x = ln(x, "transformer.final_layernorm")
    x = ln(x, "to_logits.0")
    return lin(x, "to_logits.1"), text


def spec_loss(logits, text, img, text_len, vocab, img_weight=7):
    # position t < text_len predicts text[t+1] (t < text_len-1) or img[0] (t = text_len-1),
    # all through the TEXT slice; image position text_len+j (j < N-1) predicts img[j+1]
    # through the image slice; the last position predicts nothing.
    text_targets = torch.cat([text[:, 1:], img[:, :1]], dim=1)
    lt = F.cross_entropy(logits[:, :text_len, :vocab].reshape(-1, vocab), text_targets.reshape(-1))
    li_logits = logits[:, text_len:-1, vocab:]
    li = F.cross_entropy(li_logits.reshape(-1, li_logits.shape[-1]), img[:, 1:].reshape(-1))
    return (lt + img_weight * li) / (img_weight + 1), lt, li


sd = {k: v.detach() for k, v in model.state_dict().items()}
with torch.no_grad():
    spec_logits, spec_text = spec_forward(sd, ids, T, W, V, HEADS, LAYERS, mask=attention_mask[0, 0])
    spec_l, spec_lt, spec_li = spec_loss(spec_logits, spec_text, image_ids, T, V)
spec_err = (spec_logits - logits).abs().max().item()
assert spec_err < 1e-4, spec_err
assert abs(spec_l.item() - loss.item()) < 1e-5 and abs(spec_lt.item() - parts["text"].item()) < 1e-5
assert abs(spec_li.item() - parts["image"].item()) < 1e-5
for i in range(LAYERS):
    assert torch.equal(layer_masks[i].bool(), spec_mask(spec_layer_kind(i, LAYERS), T, W)), i
# The model's conv kernel is fixed at 11: on a 4x4 grid it is the plain causal mask.
assert torch.equal(model.transformer.conv_mask, torch.tril(torch.ones(L, L, dtype=torch.bool)))

# ---------------------------------------------------------------------------------------
# Standalone masks
# ---------------------------------------------------------------------------------------
ia = image_attention
mask_tensors, mask_checks = {}, []
for text_tokens, w in ((6, 4), (6, 8)):
    tag = f"t{text_tokens}_w{w}"
    helpers = {
        "row": (ia.get_row_mask(text_tokens, w, is_bool_mask=True), ("row", 11, "v3")),
        "col": (ia.get_col_mask(text_tokens, w, is_bool_mask=True), ("col", 11, "v3")),
    }
    for kernel in ((3, 11) if w == 4 else (3, 5, 11)):
        for version in ("v2", "v3"):
            helpers[f"conv_{version}_k{kernel}"] = (
                ia.get_conv_mask(text_tokens, w, kernel=kernel, is_bool_mask=True, hf_version=version),
                ("conv", kernel, version))
    for name, (m, (kind, kernel, version)) in helpers.items():
        float_version = {"row": ia.get_row_mask, "col": ia.get_col_mask}.get(kind)
        m_float = (float_version(text_tokens, w, is_bool_mask=False) if float_version else
                   ia.get_conv_mask(text_tokens, w, kernel=kernel, is_bool_mask=False, hf_version=version))
        assert torch.equal(m_float.bool(), m) and bool(((m_float == 0) | (m_float == 1)).all())
        assert torch.equal(m, spec_mask(kind, text_tokens, w, kernel, version)), (tag, name)
        mask_tensors[f"{tag}.{name}"] = m.to(torch.uint8)
        mask_checks.append(f"{tag}.{name}")

# ---------------------------------------------------------------------------------------
# The layer pattern the package builds for every layer count from 1 to 16: which of its
# three masks _get_layer_mask hands each layer (0 row, 1 column, 2 conv).
# ---------------------------------------------------------------------------------------
PATTERN_CODES = {"row": 0, "col": 1, "conv": 2}
with torch.random.fork_rng():
    for num_layers in range(1, 17):
        small = dalle_pkg.get_rudalle_model(
            "dummy", pretrained=False, fp16=False, device="cpu", num_layers=num_layers, hidden_size=8,
            num_attention_heads=2, text_seq_length=6, image_tokens_per_dim=4, vocab_size=16, image_vocab_size=8)
        masks = small.transformer
        kinds = []
        for i in range(num_layers):
            handed = masks._get_layer_mask(i)
            kind = next(k for k, m in (("row", masks.row_mask), ("col", masks.col_mask), ("conv", masks.conv_mask))
                        if handed is m)
            assert kind == spec_layer_kind(i, num_layers), (num_layers, i, kind)
            kinds.append(PATTERN_CODES[kind])
        mask_tensors[f"pattern.layers_{num_layers}"] = torch.tensor(kinds, dtype=torch.uint8)

# ---------------------------------------------------------------------------------------
# Write
# ---------------------------------------------------------------------------------------
def save_reproducibly(tensors, path, metadata):
    """save_file, then sort the metadata in the header: safetensors writes it from a hash
    map, in a different order on every run, and the fixtures should be byte-reproducible."""
    save_file(tensors, str(path), metadata=metadata)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header = {"__metadata__": dict(sorted(header.pop("__metadata__").items())), **header}
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])


fixtures = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
tensors = {f"state.{k}": v.contiguous() for k, v in sd.items()}
tensors |= {
    "input.ids": ids,
    "input.attention_mask": attention_mask[:, 0].to(torch.uint8),  # [B, L, L], passed as [B,1,L,L]
    "output.logits": logits,
    "output.loss": loss.reshape(()),
    "output.loss_text": parts["text"].reshape(()),
    "output.loss_image": parts["image"].reshape(()),
    "act.embeddings": embeddings,
    "act.final_layernorm": final_ln,
    "cache.prefix_len": torch.tensor(PREFIX, dtype=torch.int64),
    "cache.prefix_logits": prefix_logits,
    "cache.step_ends": torch.tensor(step_ends, dtype=torch.int64),
    "cache.step_logits": step_logits,
    "cache.step_logits_rows_before_last_match": torch.tensor(int(older_rows_match), dtype=torch.uint8),
}
tensors |= {f"mask.layer_{i}": m for i, m in layer_masks.items()}
tensors |= {f"act.layer_{i}": o for i, o in outs.items()}
metadata = {
    "generator": f"rudalle 1.1.3 (dalle/model.py DalleModel via get_rudalle_model('dummy', "
                 f"pretrained=False)), torch {torch.__version__}",
    "hf_version": "v3", "num_layers": str(LAYERS), "hidden_size": str(HIDDEN),
    "num_attention_heads": str(HEADS), "text_seq_length": str(T),
    "text_vocab_without_padding": str(TEXT_VOCAB), "vocab_size": str(V),
    "image_tokens_per_dim": str(W), "image_vocab_size": str(IMAGE_VOCAB),
    "layernorm_epsilon": "1e-5", "cogview_sandwich_layernorm": "true", "cogview_pb_relax": "true",
    "conv_kernel": "11", "loss_img_weight": "7",
    "layer_kinds": ",".join(spec_layer_kind(i, LAYERS) for i in range(LAYERS)),
}
out = fixtures / "rudalle_prior_parity.safetensors"
save_reproducibly({k: v.contiguous() for k, v in tensors.items()}, out, metadata)
out_masks = fixtures / "rudalle_masks.safetensors"
save_reproducibly(mask_tensors, out_masks, {
    "generator": "rudalle 1.1.3 dalle/image_attention.py (is_bool_mask=True), stored as uint8",
    "layout": "mask[query, key], 1 = visible; name = t<text tokens>_w<grid width>.<kind>",
    "pattern": "pattern.layers_<L>: the mask of each of L layers, 0 row, 1 column, 2 conv"})

# ---------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------
def show(m, text):
    rows = []
    for q in range(m.shape[0]):
        line = "".join("#" if m[q, k] else "." for k in range(m.shape[1]))
        rows.append(line[:text] + "|" + line[text:])
    return "\n".join(rows)


print(f"rudalle at {RUDALLE_ROOT}, torch {torch.__version__}")
print(f"model: {LAYERS} layers, d {HIDDEN}, {HEADS} heads, T {T}, grid {W}x{W}, "
      f"vocab {V} (= {TEXT_VOCAB} + {T} padding ids) + {IMAGE_VOCAB} image codes, "
      f"{sum(p.numel() for p in model.parameters())} parameters")
print("layer kinds:", [spec_layer_kind(i, LAYERS) for i in range(LAYERS)])
print("input ids:\n", ids)
print("text after padding replacement:\n", spec_text)
print(f"logits {tuple(logits.shape)} reproducible; |logits| max {logits.abs().max():.4f}")
print(f"loss {loss.item():.6f} = (text {parts['text'].item():.6f} + 7 * image "
      f"{parts['image'].item():.6f}) / 8")
print(f"spec re-implementation: max |logit diff| {spec_err:.2e}, loss diff "
      f"{abs(spec_l.item() - loss.item()):.2e}")
print(f"kv cache: prefix {PREFIX}, prefix max diff {prefix_err:.2e}, newest-row max diff "
      f"{cache_err:.2e}, older rows of cached calls match the full forward: {older_rows_match}")
print("cache layout after prefix call:", cache_layout)
print("cache layout after last call:", cache_layout_final)
for i in range(LAYERS):
    print(f"mask.layer_{i} ({spec_layer_kind(i, LAYERS)}):\n{show(layer_masks[i], T)}")
for name in ("t6_w4.conv_v2_k3", "t6_w4.conv_v3_k3"):
    print(f"{name}:\n{show(mask_tensors[name], 6)}")
print(f"standalone masks checked against the spec: {', '.join(mask_checks)}")
print(f"wrote {out} ({out.stat().st_size} bytes, {len(tensors)} tensors)")
print(f"wrote {out_masks} ({out_masks.stat().st_size} bytes, {len(mask_tensors)} tensors)")

"""Parity fixture for min-dalle (PyPI `min-dalle` 0.4.11): DALL-E Mega / Mini's BART
encoder-decoder prior, its sampler, its VQGAN detokenizer and its text tokenizer, built by
the package's own classes at a small size with random weights, saved as
tests/fixtures/mindalle_parity.safetensors. docs/mega-prior.md describes what is checked;
the script also re-implements the encoder, the cached decoder step, the sampler's weights
and the tokenizer from that description and asserts they match the package.

Environment (no network at run time; torch, numpy, typing_extensions and safetensors come
from the project venv ~/.cache/dalle/venv through a .pth file, as for the rudalle venv):
    python3 -m venv ~/.cache/dalle/mindalle-venv
    echo ~/.cache/dalle/venv/lib/python3.11/site-packages \
        > ~/.cache/dalle/mindalle-venv/lib/python3.11/site-packages/dalle-torch.pth
    ~/.cache/dalle/mindalle-venv/bin/pip install --no-deps min-dalle==0.4.11
    ~/.cache/dalle/mindalle-venv/bin/pip install pillow requests emoji   # emoji 2.16.0 here
    ~/.cache/dalle/mindalle-venv/bin/python tests/parity/make_mindalle_fixture.py
(`min_dalle.min_dalle` imports PIL, requests and numpy at module level, the tokenizer emoji;
nothing is downloaded: MinDalle.__init__, which fetches weights, is never called.)
It takes a few seconds on one core and writes a byte-identical file on every run.

What the package hard-codes, and how the small build gets around it:
* DalleBartEncoder: batch 2 (`pose_tokens` is two rows of positions), which is what the
  generator always passes ([unconditioned, conditioned] text rows). Used as is with
  text_token_count 64 (min_dalle.py builds [2, 64] text rows itself).
* DalleBartDecoder: IMAGE_TOKEN_COUNT = 256 positions (position table, KV cache length,
  self-attention mask). Used as is; the per-step fixture runs the first 16 of the 256
  steps (one 16-token row of the grid, teacher-forced) and stores cache positions 0..15
  (the later positions are asserted to be still zero). `sample_tokens` keeps logit columns
  `[:2**14]` (the VQGAN codes) and `generate_raw_image_stream` starts every image with the
  token 2**14 - 1 = 16383; with 16 codes neither literal fits, so the sampling run wraps the
  decoder (`CodesOnlyDecoder`): prev token 16383 is replaced by START (= codes - 1, the
  small model's "last VQGAN code", as 16383 is the real one) and the logits are cut to the
  first CODES columns before sample_tokens sees them. Everything else in the sampling run
  is the package's own MinDalle.generate_raw_image_stream (tokenizer, text rows, encoder,
  batch expansion, cache allocation, seed, sample_tokens, torch.multinomial), on a
  MinDalle object made without __init__.
* VQGanDetokenizer: every width is a literal (2**8 codebook width, 2**9/2**8/2**7
  channels, 16x16 tokens per image, GroupNorm(2**5, .)). The small detokenizer keeps the
  module tree and names: ResnetBlock, Upsample and UpsampleBlock are the package's classes
  (constructed while `vqgan_detokenizer.nn.GroupNorm` is redirected to GroupNorm(GROUPS,
  c), the only change); MiddleLayer, Decoder and VQGanDetokenizer are subclasses whose
  __init__ takes widths (Decoder.forward and MiddleLayer.forward are the package's);
  AttentionBlock.forward and VQGanDetokenizer.forward are copied with the literals
  replaced by the block width / tokens per side, and the script checks the copies
  against the package's originals at the package's own sizes (random weights; a cheap
  stand-in for the convolutional decoder in the detokenizer check).

Weights are small integers times a power of two per tensor, stored as int8 beside that
scale (`<name>` I8 and `<name>:scale` F32, as in vqgan_parity.safetensors); the models
compute with exactly those values. Names: `encoder.<min-dalle name>`,
`decoder.<min-dalle name>`, `detokenizer.<min-dalle name>`.
"""
import json
import math
import pathlib
import sys
import warnings

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import emoji
import min_dalle.min_dalle as md  # sets grad off and num_threads, as the package does
import min_dalle.models.dalle_bart_decoder as dbd
import min_dalle.models.vqgan_detokenizer as vq
from min_dalle.models import DalleBartDecoder, DalleBartEncoder, VQGanDetokenizer
from min_dalle.text_tokenizer import TextTokenizer

torch.set_num_threads(1)
# generate_raw_image_stream enters torch.cuda.amp.autocast, deprecated and a no-op on CPU
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
torch.set_grad_enabled(False)

# ---------------------------------------------------------------------------------------
# Sizes (mega / mini in min_dalle.py: layers 24/12, heads 32/16, d 2048/1024,
# glu 4096/2730, text vocab 50272/50264, image vocab 16415/16384, text 64, image 256)
# ---------------------------------------------------------------------------------------
LAYERS, HEADS, EMBED, GLU = 2, 4, 32, 44
TEXT_TOKENS = 64
CODES = 16                 # VQGAN codebook (real: 2**14)
IMAGE_VOCAB = CODES + 3    # decoder image_vocab_count; mega-like: more columns than codes
START = CODES - 1          # stands for 2**14 - 1
IMAGE_TOKENS = dbd.IMAGE_TOKEN_COUNT  # 256, the package's constant
STEPS = 16                 # teacher-forced cached steps in the per-step fixture
STEP_IMAGES = 2            # image_count in the per-step fixture (batch 2 * 2)
# detokenizer: log2 widths standing for the real 7, 8, 9 (128, 256, 512 channels)
L7, L8, L9 = 3, 4, 4
Z_EMBED = 8                # codebook width (real 2**8)
GROUPS = 4                 # GroupNorm groups (real 2**5)
DETOK_SIDE = 2             # tokens per image side in the detokenizer fixture (real 16)
DETOK_GRID = 2             # images per grid side

# ---------------------------------------------------------------------------------------
# Tokenizer: a BART-style vocab.json / merges.txt made here
# ---------------------------------------------------------------------------------------
G = chr(ord(" ") + 256)    # 'Ġ', GPT-2's symbol for the space byte
MERGES = [f"{G} t", "h e", f"{G}t he", f"{G} a", "a t", f"{G} c", f"{G}c at", "o g", f"{G} d",
          f"{G}d og", f"{G} s", f"{G}s at", "_ f", "a c", "_f ac", "e s", f"{G} m", f"{G}m at",
          "o n", f"{G} on", f"{G}d o", "a a"]
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
SYMBOLS = [G] + list("abcdefghiklmnorstuwy_!,")
VOCAB_LIST = SPECIALS + SYMBOLS + ["".join(m.split()) for m in MERGES if "".join(m.split()) not in
                                   (f"{G}do",)]  # 'Ġdo' merges but is not in the vocab -> <unk>
VOCAB = {s: i for i, s in enumerate(dict.fromkeys(VOCAB_LIST))}
VOCAB_JSON = json.dumps(VOCAB, ensure_ascii=False, sort_keys=False)
MERGES_TXT = "#version: 0.2\n" + "\n".join(MERGES) + "\n"
CAPTIONS = [
    "The cat sat on the mat",
    "a  dog\U0001F436 and   the cats!",       # double spaces, emoji -> 'dog_face'
    "THE\tCAT, caf\u00e9 \u212aat",           # tab stays inside a word; é dropped; Kelvin sign -> k
    "aaaa  aaa dodo x",                        # repeated merge, merge result missing from vocab, unknown char
    "",                                         # empty caption: just <s> </s>
    " ".join(["the cat"] * 40),                 # 82 ids: truncated to 64 by the generator
]
TEXT_VOCAB = len(VOCAB)


def quantized_randomize(module, generator, prefix):
    """Random q * 2^-e, |q| <= 127, for every parameter; returns the int8 q and scales.
    Norm gains in [0.5, 1), biases within +-0.25, matrices about N(0, 1/fan_in),
    embeddings about N(0, 1)."""
    stored = {}
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)
        is_norm = isinstance(module.get_submodule(leaf[0]), (torch.nn.LayerNorm, torch.nn.GroupNorm))
        if is_norm and leaf[1] == "weight":
            q, e = torch.randint(64, 128, p.shape, generator=generator), 7
        elif p.dim() == 1:
            q, e = torch.randint(-127, 128, p.shape, generator=generator), 9
        else:
            fan_in = 1 if isinstance(module.get_submodule(leaf[0]), torch.nn.Embedding) else p[0].numel()
            e = max(0, round(math.log2(127.0 * fan_in ** 0.5 / 3 ** 0.5)))
            q = torch.randint(-127, 128, p.shape, generator=generator)
        p.copy_(q.float() * 2.0 ** -e)
        stored[f"{prefix}.{name}"] = q.to(torch.int8)
        stored[f"{prefix}.{name}:scale"] = torch.tensor(2.0 ** -e, dtype=torch.float32)
    return stored


# ---------------------------------------------------------------------------------------
# Small detokenizer from the package's classes
# ---------------------------------------------------------------------------------------
class _NN:
    """torch.nn as vqgan_detokenizer sees it while small modules are built: GroupNorm's
    group count (the literal 2**5) becomes GROUPS."""
    def __getattr__(self, name):
        return getattr(torch.nn, name)

    @staticmethod
    def GroupNorm(groups, channels):  # noqa: N802
        return torch.nn.GroupNorm(GROUPS, channels)


class WidthAttentionBlock(vq.AttentionBlock):
    """vq.AttentionBlock with the literal width 2**9 replaced by `n` (forward copied)."""
    def __init__(self, n, groups=32):
        torch.nn.Module.__init__(self)
        self.n = n
        self.norm = torch.nn.GroupNorm(groups, n)
        self.q = torch.nn.Conv2d(n, n, 1)
        self.k = torch.nn.Conv2d(n, n, 1)
        self.v = torch.nn.Conv2d(n, n, 1)
        self.proj_out = torch.nn.Conv2d(n, n, 1)

    def forward(self, x):
        n, m = self.n, x.shape[0]
        h = self.norm(x)
        k, v, q = self.k.forward(h), self.v.forward(h), self.q.forward(h)
        k, v, q = k.reshape(m, n, -1), v.reshape(m, n, -1), q.reshape(m, n, -1)
        q = q.permute(0, 2, 1)
        w = torch.bmm(q, k)
        w /= n ** 0.5
        w = torch.softmax(w, dim=2)
        w = w.permute(0, 2, 1)
        h = torch.bmm(v, w)
        token_count = int(math.sqrt(h.shape[-1]))
        h = h.reshape(m, n, token_count, token_count)
        h = self.proj_out.forward(h)
        return x + h


class SmallMiddleLayer(vq.MiddleLayer):
    def __init__(self):
        torch.nn.Module.__init__(self)
        self.block_1 = vq.ResnetBlock(L9, L9)
        self.attn_1 = WidthAttentionBlock(2 ** L9, GROUPS)
        self.block_2 = vq.ResnetBlock(L9, L9)


class SmallDecoder(vq.Decoder):
    """vq.Decoder's tree (conv_in, mid, up.0-4, norm_out, conv_out) at small widths;
    forward is the package's."""
    def __init__(self):
        torch.nn.Module.__init__(self)
        self.conv_in = torch.nn.Conv2d(Z_EMBED, 2 ** L9, 3, padding=1)
        self.mid = SmallMiddleLayer()
        saved = vq.AttentionBlock
        vq.AttentionBlock = lambda: WidthAttentionBlock(2 ** L9, GROUPS)
        try:
            self.up = torch.nn.ModuleList([
                vq.UpsampleBlock(L7, L7, False, False),
                vq.UpsampleBlock(L8, L7, False, True),
                vq.UpsampleBlock(L8, L8, False, True),
                vq.UpsampleBlock(L9, L8, False, True),
                vq.UpsampleBlock(L9, L9, True, True),
            ])
        finally:
            vq.AttentionBlock = saved
        self.norm_out = torch.nn.GroupNorm(GROUPS, 2 ** L7)
        self.conv_out = torch.nn.Conv2d(2 ** L7, 3, 3, padding=1)


class WidthDetokenizer(vq.VQGanDetokenizer):
    """vq.VQGanDetokenizer with the literals 2**14 (codes), 2**8 (codebook width and image
    side) and 2**4 (tokens per side) taken from the modules and the input (forward copied)."""
    def __init__(self, codes, embed, decoder, upsampling):
        torch.nn.Module.__init__(self)
        self.vocab_count = codes
        self.embedding = torch.nn.Embedding(codes, embed)
        self.post_quant_conv = torch.nn.Conv2d(embed, embed, 1)
        self.decoder = decoder
        self.upsampling = upsampling

    def forward(self, is_seamless, z):
        embed = self.embedding.weight.shape[1]
        side = int(math.sqrt(z.shape[1]))               # 2**4 in the package
        pixels = side * self.upsampling                  # 2**8 in the package
        grid_size = int(math.sqrt(z.shape[0]))
        token_count = grid_size * side
        if is_seamless:
            z = z.view([grid_size, grid_size, side, side])
            z = z.flatten(1, 2).transpose(1, 0).flatten(1, 2)
            z = z.flatten().unsqueeze(1)
            z = self.embedding.forward(z)
            z = z.view((1, token_count, token_count, embed))
        else:
            z = self.embedding.forward(z)
            z = z.view((z.shape[0], side, side, embed))
        z = z.permute(0, 3, 1, 2).contiguous()
        z = self.post_quant_conv.forward(z)
        z = self.decoder.forward(z)
        z = z.permute(0, 2, 3, 1)
        z = z.clip(0.0, 1.0) * 255
        if is_seamless:
            z = z[0]
        else:
            z = z.view([grid_size, grid_size, pixels, pixels, 3])
            z = z.flatten(1, 2).transpose(1, 0).flatten(1, 2)
        return z


def check_copies_at_package_size(generator):
    """The two copied forwards equal the package's at the package's sizes."""
    torch.manual_seed(123)
    original = vq.AttentionBlock().eval()
    copy = WidthAttentionBlock(2 ** 9).eval()
    copy.load_state_dict(original.state_dict())
    x = torch.randn(2, 2 ** 9, 16, 16, generator=generator)
    assert torch.equal(original(x), copy(x)), "AttentionBlock copy differs"

    stand_in = torch.nn.Sequential(torch.nn.Upsample(scale_factor=16), torch.nn.Conv2d(256, 3, 1))
    full = VQGanDetokenizer().eval()
    full.decoder = stand_in
    generic = WidthDetokenizer(2 ** 14, 2 ** 8, stand_in, 16).eval()
    generic.embedding.load_state_dict(full.embedding.state_dict())
    generic.post_quant_conv.load_state_dict(full.post_quant_conv.state_dict())
    tokens = torch.randint(0, 2 ** 14, (4, 256), generator=generator)
    for seamless in (False, True):
        a, b = full.forward(seamless, tokens), generic.forward(seamless, tokens)
        assert a.shape == b.shape and torch.equal(a, b), f"detokenizer copy differs (seamless={seamless})"
    return True


# ---------------------------------------------------------------------------------------
# Independent re-implementation of docs/mega-prior.md
# ---------------------------------------------------------------------------------------
def spec_ln(x, sd, p):
    return F.layer_norm(x, (x.shape[-1],), sd[p + ".weight"], sd[p + ".bias"], 1e-5)


def spec_attention(sd, p, x_q, x_kv, mask, heads, k=None, v=None):
    """mask [B, Lk] bool (True = visible); k, v given: the cached keys/values [B, Lk, d]."""
    b, lq, d = x_q.shape
    hd = d // heads
    q = (x_q @ sd[p + ".q_proj.weight"].T).view(b, lq, heads, hd) / math.sqrt(hd)
    if k is None:
        k = x_kv @ sd[p + ".k_proj.weight"].T
        v = x_kv @ sd[p + ".v_proj.weight"].T
    k = k.reshape(b, -1, heads, hd)
    v = v.reshape(b, -1, heads, hd)
    s = torch.einsum("bqhc,bkhc->bhqk", q, k) + (~mask)[:, None, None, :].float() * -1e12
    o = torch.einsum("bhqk,bkhc->bqhc", torch.softmax(s, -1), v).reshape(b, lq, d)
    return o @ sd[p + ".out_proj.weight"].T


def spec_glu(sd, p, x):
    h = spec_ln(x, sd, p + ".ln0")
    h = F.gelu(h @ sd[p + ".fc0.weight"].T) * (h @ sd[p + ".fc1.weight"].T)   # exact (erf) GELU
    return spec_ln(h, sd, p + ".ln1") @ sd[p + ".fc2.weight"].T


def spec_encoder(sd, text):
    mask = text != 1
    x = sd["embed_tokens.weight"][text] + sd["embed_positions.weight"][torch.arange(text.shape[1])]
    x = spec_ln(x, sd, "layernorm_embedding")
    for i in range(LAYERS):
        p = f"layers.{i}"
        h = spec_ln(x, sd, p + ".pre_self_attn_layer_norm")
        x = x + spec_ln(spec_attention(sd, p + ".self_attn", h, h, mask, HEADS), sd, p + ".self_attn_layer_norm")
        x = x + spec_glu(sd, p + ".glu", x)
    return spec_ln(x, sd, "final_ln")


def spec_decoder_step(sd, enc, text, cache, token, pos):
    """One cached step for all 2 * n rows. cache: [LAYERS, 2, 2n, 256, d] (k, v)."""
    x = sd["embed_tokens.weight"][token] + sd["embed_positions.weight"][pos]
    x = spec_ln(x, sd, "layernorm_embedding")[:, None]
    self_mask = (torch.arange(cache.shape[3]) <= pos)[None].expand(x.shape[0], -1)
    cross_mask = text != 1
    for i in range(LAYERS):
        p = f"layers.{i}"
        h = spec_ln(x, sd, p + ".pre_self_attn_layer_norm")
        cache[i, 0, :, pos] = h[:, 0] @ sd[p + ".self_attn.k_proj.weight"].T
        cache[i, 1, :, pos] = h[:, 0] @ sd[p + ".self_attn.v_proj.weight"].T
        a = spec_attention(sd, p + ".self_attn", h, None, self_mask, HEADS, cache[i, 0], cache[i, 1])
        x = x + spec_ln(a, sd, p + ".self_attn_layer_norm")
        h = spec_ln(x, sd, p + ".pre_encoder_attn_layer_norm")
        a = spec_attention(sd, p + ".encoder_attn", h, enc, cross_mask, HEADS)
        x = x + spec_ln(a, sd, p + ".encoder_attn_layer_norm")
        x = x + spec_glu(sd, p + ".glu", x)
    return spec_ln(x, sd, "final_ln")[:, 0] @ sd["lm_head.weight"].T


def spec_sampling_weights(logits, codes, temperature, top_k, factor):
    n = logits.shape[0] // 2
    l = logits[:, :codes]
    l = l[:n] * (1 - factor) + l[n:] * factor              # = uncond + factor * (cond - uncond)
    kth = l.sort(dim=1, descending=True).values[:, top_k - 1:top_k]
    return torch.exp((l - l.max(dim=1, keepdim=True).values) / temperature) * (l >= kth)


def spec_tokenize(text, vocab, merges):
    """GPT-2-style merging (every occurrence of the best pair per round)."""
    rank = {tuple(m.split()): r for r, m in enumerate(merges)}
    text = emoji.demojize(text, delimiters=("", "")).lower().encode("ascii", "ignore").decode()
    ids = [vocab["<s>"]]
    for word in (w for w in text.split(" ") if w):
        sym = [G] + list(word)
        while len(sym) > 1:
            best = min(((rank.get(pair, math.inf), pair) for pair in zip(sym, sym[1:])))
            if best[0] == math.inf:
                break
            out, i = [], 0
            while i < len(sym):
                if i + 1 < len(sym) and (sym[i], sym[i + 1]) == best[1]:
                    out.append(sym[i] + sym[i + 1])
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            sym = out
        ids += [vocab.get(s, vocab["<unk>"]) for s in sym]
    return ids + [vocab["</s>"]]


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------
class CodesOnlyDecoder(DalleBartDecoder):
    """For the sampling run only: maps the generator's start token 2**14 - 1 to START and
    keeps the first CODES logit columns (what sample_tokens' [:2**14] keeps in the real
    model). The per-step fixture calls DalleBartDecoder.forward unwrapped."""
    def forward(self, attention_mask, encoder_state, attention_state, prev_tokens, token_index):
        prev_tokens = torch.where(prev_tokens == 2 ** 14 - 1, START, prev_tokens)
        logits, attention_state = super().forward(attention_mask, encoder_state, attention_state,
                                                  prev_tokens, token_index)
        return logits[..., :CODES], attention_state


def main():
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    copies_checked = check_copies_at_package_size(generator)

    # Tokenizer (as MinDalle.init_tokenizer reads the files)
    merges = MERGES_TXT.split("\n")[1:-1]
    tokenizer = TextTokenizer(json.loads(VOCAB_JSON), merges)
    token_lists = [tokenizer.tokenize(c) for c in CAPTIONS]
    for c, ids in zip(CAPTIONS, token_lists):
        assert ids == spec_tokenize(c, VOCAB, merges), (c, ids)
    tensors["tokenizer.ids"] = torch.tensor(sum(token_lists, []), dtype=torch.int64)
    tensors["tokenizer.offsets"] = torch.tensor([0] + [len(t) for t in token_lists], dtype=torch.int64).cumsum(0)

    # Models
    torch.manual_seed(0)
    encoder = DalleBartEncoder(layer_count=LAYERS, embed_count=EMBED, attention_head_count=HEADS,
                               text_vocab_count=TEXT_VOCAB, text_token_count=TEXT_TOKENS,
                               glu_embed_count=GLU, device="cpu").eval()
    decoder = CodesOnlyDecoder(image_vocab_count=IMAGE_VOCAB, embed_count=EMBED, attention_head_count=HEADS,
                               glu_embed_count=GLU, layer_count=LAYERS, device="cpu").eval()
    saved_nn = vq.nn
    vq.nn = _NN()
    try:
        detok = WidthDetokenizer(CODES, Z_EMBED, SmallDecoder(), 16).eval()
    finally:
        vq.nn = saved_nn
    tensors |= quantized_randomize(encoder, generator, "encoder")
    tensors |= quantized_randomize(decoder, generator, "decoder")
    tensors |= quantized_randomize(detok, generator, "detokenizer")
    enc_sd = {k: v.clone() for k, v in encoder.state_dict().items()}
    dec_sd = {k: v.clone() for k, v in decoder.state_dict().items()}

    # Encoder on the two rows generate_raw_image_stream builds for caption 0
    ids = token_lists[0]
    text = torch.ones(2, TEXT_TOKENS, dtype=torch.long)
    text[0, :2] = torch.tensor([ids[0], ids[-1]])
    text[1, :len(ids)] = torch.tensor(ids)
    enc_out = encoder.forward(text)
    assert (spec_encoder(enc_sd, text) - enc_out).abs().max() < 1e-4
    tensors["encoder.input.text_tokens"] = text
    tensors["encoder.output"] = enc_out

    # Decoder: STEPS teacher-forced cached steps for STEP_IMAGES images (unwrapped forward)
    n = STEP_IMAGES
    expanded = [0] * n + [1] * n
    text_x, enc_x = text[expanded], enc_out[expanded]
    attention_mask = text_x.not_equal(1)[:, None, None, :]
    state = torch.zeros(LAYERS, 4 * n, IMAGE_TOKENS, EMBED)
    prev = torch.cat([torch.full((n, 1), START), torch.randint(0, CODES, (n, STEPS - 1), generator=generator)], 1)
    positions = torch.arange(IMAGE_TOKENS)
    spec_cache = torch.zeros(LAYERS, 2, 2 * n, IMAGE_TOKENS, EMBED)
    step_logits, prefixes = [], []
    for i in range(STEPS):
        logits, state = DalleBartDecoder.forward(decoder, attention_mask, enc_x, state, prev[:, [i]], positions[[i]])
        assert logits.shape == (2 * n, 1, IMAGE_VOCAB + 1)
        step_logits.append(logits[:, -1])
        prefixes.append(state[:, :, :i + 1].clone())
        spec = spec_decoder_step(dec_sd, enc_x, text_x, spec_cache, prev.repeat(2, 1)[:, i], i)
        assert (spec - logits[:, -1]).abs().max() < 1e-4, i
    step_logits = torch.stack(step_logits)
    assert not state[:, :, STEPS:].any(), "cache positions past the last step are written"
    assert all(torch.equal(p, state[:, :, :p.shape[2]]) for p in prefixes), "cache rows change after their step"
    assert torch.allclose(spec_cache.flatten(1, 2), state, atol=1e-5)
    full_logits, _ = DalleBartDecoder.forward(decoder, attention_mask, enc_x, torch.zeros_like(state), prev,
                                              positions[:STEPS])
    full_err = (full_logits - step_logits.transpose(0, 1)).abs().max().item()
    assert full_err < 1e-4, full_err
    tensors |= {"decoder.input.encoder_rows": torch.tensor(expanded, dtype=torch.int64),
                "decoder.input.prev_tokens": prev,
                "decoder.output.step_logits": step_logits,
                "decoder.output.kv_cache": state[:, :, :STEPS].contiguous(),
                "decoder.output.full_logits": full_logits}

    # Detokenizer
    z = torch.randint(0, CODES, (DETOK_GRID ** 2, DETOK_SIDE ** 2), generator=generator)
    image = detok.forward(False, z)
    seamless = detok.forward(True, z)
    px = DETOK_SIDE * 16
    assert image.shape == (DETOK_GRID * px, DETOK_GRID * px, 3) and seamless.shape == image.shape
    tensors |= {"detokenizer.input.tokens": z, "detokenizer.output.image": image,
                "detokenizer.output.image_seamless": seamless}

    # Sampling: the package's generate_raw_image_stream on a MinDalle made without __init__
    model = md.MinDalle.__new__(md.MinDalle)
    model.__dict__.update(device="cpu", is_mega=True, is_reusable=True, dtype=torch.float32, is_verbose=False,
                          text_token_count=TEXT_TOKENS, layer_count=LAYERS, embed_count=EMBED,
                          tokenizer=tokenizer, encoder=encoder, decoder=decoder, detokenizer=detok)
    weights = []
    real_multinomial = torch.multinomial

    def recording_multinomial(w, k, *a, **kw):
        weights.append(w.clone())
        return real_multinomial(w, k, *a, **kw)

    seen_text = []  # the package calls encoder.forward() directly, so hooks would not fire
    encoder.forward = lambda t: (seen_text.append(t.clone()), DalleBartEncoder.forward(encoder, t))[1]
    runs = [  # caption index, seed, grid_size, temperature, top_k, supercondition_factor
        (1, 7, 1, 1.0, 4, 16.0),
        (5, 11, 2, 0.5, 16, 3.0),
    ]
    run_tokens, run_weights, run_text = [], [], []
    torch.multinomial = recording_multinomial
    try:
        for caption, seed, grid, temperature, top_k, factor in runs:
            weights.clear()
            captured = {}
            original_grid = model.image_grid_from_tokens
            model.image_grid_from_tokens = lambda image_tokens, **kw: captured.setdefault("t", image_tokens.clone())
            out = list(model.generate_raw_image_stream(CAPTIONS[caption], seed=seed, grid_size=grid,
                                                       temperature=temperature, top_k=top_k,
                                                       supercondition_factor=factor))
            model.image_grid_from_tokens = original_grid
            assert len(out) == 1 and len(weights) == IMAGE_TOKENS
            run_tokens.append(captured["t"])
            run_weights.append(torch.stack(weights[:8]))
            run_text.append(seen_text[-1])
    finally:
        torch.multinomial = real_multinomial
        del encoder.forward
    # the sampler's weights from the spec, on the first step of run 0, recomputed
    for r, (caption, seed, grid, temperature, top_k, factor) in enumerate(runs):
        tensors[f"sample.{r}.text_tokens"] = run_text[r]
        tensors[f"sample.{r}.image_tokens"] = run_tokens[r]
        tensors[f"sample.{r}.weights_first_8_steps"] = run_weights[r]
        tensors[f"sample.{r}.settings"] = torch.tensor([seed, grid, temperature, top_k, factor], dtype=torch.float64)
    # Check the weights recorded in run 0, step 0 against the spec sampler.
    text0 = run_text[0]
    enc0 = spec_encoder(enc_sd, text0)[[0, 1]]
    cache = torch.zeros(LAYERS, 2, 2, IMAGE_TOKENS, EMBED)
    l0 = spec_decoder_step(dec_sd, enc0, text0, cache, torch.tensor([START, START]), 0)
    w0 = spec_sampling_weights(l0, CODES, 1.0, 4, 16.0)
    assert torch.allclose(w0, run_weights[0][0], rtol=1e-4, atol=1e-6)
    # ... and the first sampled token of run 0 from the recorded weights and the seed
    torch.manual_seed(runs[0][1])
    assert torch.multinomial(run_weights[0][0], 1)[0, 0] == run_tokens[0][0, 0]

    metadata = {
        "generator": f"min-dalle 0.4.11, emoji {emoji.__version__}, torch {torch.__version__}",
        "layer_count": str(LAYERS), "attention_head_count": str(HEADS), "embed_count": str(EMBED),
        "glu_embed_count": str(GLU), "text_token_count": str(TEXT_TOKENS), "text_vocab_count": str(TEXT_VOCAB),
        "image_vocab_count": str(IMAGE_VOCAB), "image_token_count": str(IMAGE_TOKENS), "codes": str(CODES),
        "start_token": str(START), "step_count": str(STEPS), "step_images": str(STEP_IMAGES),
        "detok_log2_widths": f"{L7},{L8},{L9}", "detok_embed": str(Z_EMBED), "detok_groups": str(GROUPS),
        "detok_upsampling": "16", "detok_tokens_per_side": str(DETOK_SIDE), "detok_grid": str(DETOK_GRID),
        "layernorm_eps": "1e-5", "groupnorm_eps": "1e-5",
        "tokenizer.vocab_json": VOCAB_JSON, "tokenizer.merges_txt": MERGES_TXT,
        "tokenizer.captions": json.dumps(CAPTIONS, ensure_ascii=False),
        "sample.runs": "caption index, seed, grid_size, temperature, top_k, supercondition_factor: "
                       + json.dumps(runs),
        "kv_cache_layout": "[layer, 4n, position, d]: rows 0..2n-1 keys, 2n..4n-1 values; within each, "
                           "n unconditioned rows then n conditioned",
    }
    out = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "mindalle_parity.safetensors"
    save_reproducibly({k: v.contiguous() for k, v in tensors.items()}, out, metadata)

    print(f"min-dalle at {pathlib.Path(md.__file__).parent}, torch {torch.__version__}, emoji {emoji.__version__}")
    print("copied AttentionBlock / VQGanDetokenizer.forward equal the package's:", copies_checked)
    for c, t in zip(CAPTIONS, token_lists):
        print(f"  {c[:40]!r:44} -> {t if len(t) < 20 else str(t[:12])[:-1] + ', ...] (' + str(len(t)) + ')'}")
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in
              (("encoder", encoder), ("decoder", decoder), ("detokenizer", detok))}
    print("parameters:", params)
    print(f"decoder: {STEPS} cached steps match the uncached 16-token forward to {full_err:.1e}")
    for r, t in enumerate(run_tokens):
        print(f"sample run {r} {runs[r]}: tokens {tuple(t.shape)}, first row {t[0, :16].tolist()}")
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(tensors)} tensors)")


def save_reproducibly(tensors, path, metadata):
    """save_file, then sort the metadata in the header (safetensors writes it from a hash
    map, in a different order on every run)."""
    save_file(tensors, str(path), metadata=metadata)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header = {"__metadata__": dict(sorted(header.pop("__metadata__").items())), **header}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    assert len(text) <= n
    path.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])


if __name__ == "__main__":
    sys.exit(main())

"""min-dalle 0.4.11's own generation loop (MinDalle.generate_raw_image_stream) timed as
`dalle_bench_prior generation-mega` times ours: DALL-E Mega's layout (or Mini's, --mini),
random weights (the package's DalleBartEncoder and DalleBartDecoder as MinDalle.init_encoder
and init_decoder build them, without loading files), `--images` images of one caption, the
rate taken between the 4th image token and the 4 + N-th, and the peak resident memory.
Prints one JSON line (docs/benchmarks.md).

The loop is the package's, called as it is on a MinDalle made without __init__ (which would
download weights); its decoder's sample_tokens is wrapped only to count the steps.

With --whole, the whole grid is timed instead, caption to pixels (all 256 steps and the
VQGAN detokenizer, random weights too), twice: the first grid warms the kernels up. On a GPU
(--device cuda) every timed step is waited for.

Environment: the min-dalle venv of tests/parity/make_mindalle_fixture.py.
    OMP_NUM_THREADS=2 ~/.cache/dalle/mindalle-venv/bin/python scripts/bench-mindalle-generation.py --images 1
On a lent GPU machine, whose python has torch and numpy but maybe not min-dalle's other
imports (PIL, requests, emoji: used only to download files, tokenize and save pictures, none
of which runs here), those are stood in for; min-dalle's sdist unpacked on PYTHONPATH.
"""
import argparse
import importlib.util
import json
import resource
import sys
import time
import types

import torch

for missing in ("PIL", "requests", "emoji"):
    if importlib.util.find_spec(missing) is None:
        stand_in = sys.modules[missing] = types.ModuleType(missing)
        stand_in.Image = types.SimpleNamespace(Image=object)
        stand_in.demojize = lambda text, **_: text

import min_dalle.min_dalle as md  # noqa: E402
from min_dalle.models import DalleBartDecoder, DalleBartEncoder, VQGanDetokenizer  # noqa: E402


class EnoughTokens(Exception):
    pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1, help="a square number: min-dalle draws grids")
    parser.add_argument("--tokens", type=int, default=16, help="image tokens timed after the first 4")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--mini", action="store_true", help="DALL-E Mini's layout instead of Mega's")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--whole", action="store_true", help="time whole grids, caption to pixels")
    args = parser.parse_args()
    if not 1 <= args.tokens <= 250:
        raise SystemExit("--tokens must be in 1..250: min-dalle's loop ends at 256 and would then decode the image")
    grid = round(args.images ** 0.5)
    if grid * grid != args.images:
        raise SystemExit("--images must be a square number (min-dalle draws grid_size ** 2 images)")
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(torch.get_num_threads())  # min_dalle sets every core; OMP_NUM_THREADS decides here
    sizes = (dict(layer_count=12, embed_count=1024, attention_head_count=16, glu_embed_count=2730,
                  text_vocab_count=50264, image_vocab_count=16384) if args.mini else
             dict(layer_count=24, embed_count=2048, attention_head_count=32, glu_embed_count=4096,
                  text_vocab_count=50272, image_vocab_count=16415))
    torch.manual_seed(0)
    common = dict(attention_head_count=sizes["attention_head_count"], embed_count=sizes["embed_count"],
                  glu_embed_count=sizes["glu_embed_count"], layer_count=sizes["layer_count"], device=args.device)
    encoder = DalleBartEncoder(text_token_count=64, text_vocab_count=sizes["text_vocab_count"], **common)
    encoder = encoder.to(dtype).to(args.device).eval()
    decoder = DalleBartDecoder(image_vocab_count=sizes["image_vocab_count"], **common).to(dtype).to(args.device).eval()
    parameters = sum(p.numel() for m in (encoder, decoder) for p in m.parameters())
    detokenizer = VQGanDetokenizer().to(args.device).eval() if args.whole else None  # float32, as min-dalle's
    rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    class Tokenizer:
        def tokenize(self, text, is_verbose=False):
            return [0] + list(range(100, 120)) + [2]

    model = md.MinDalle.__new__(md.MinDalle)
    model.__dict__.update(device=args.device, is_mega=not args.mini, is_reusable=True, dtype=dtype, is_verbose=False,
                          text_token_count=64, layer_count=sizes["layer_count"], embed_count=sizes["embed_count"],
                          tokenizer=Tokenizer(), encoder=encoder, decoder=decoder, detokenizer=detokenizer)
    wait = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    line = {"model": f"min-dalle 0.4.11 {'Mini' if args.mini else 'Mega'} layout", "dtype": args.dtype,
            "device": args.device, "images": args.images, "parameters": parameters}
    if args.whole:
        line.update(benchmark="grid-mega", image_tokens=256, **whole_grids(model, grid, wait))
        line["image_tokens_per_s"] = args.images * 256 / line["seconds_per_grid"]
    else:
        if args.device == "cuda":  # as ours: a first pass picks the GPU's kernels
            timed_steps(model, decoder, grid, args.tokens, wait)
        seconds = timed_steps(model, decoder, grid, args.tokens, wait)
        line.update(benchmark="generation-mega", timed_tokens=args.tokens,
                    image_tokens_per_s=args.images * args.tokens / seconds, seconds_per_step=seconds / args.tokens,
                    threads=torch.get_num_threads(), peak_rss_mib_after_build=rss_built)
    line["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(line))


def timed_steps(model, decoder, grid, tokens, wait):
    """Seconds between the 4th and the 4 + tokens-th step of min-dalle's loop."""
    untimed, calls, started = 4, [0], [0.0]
    sample_tokens = decoder.sample_tokens

    def counting(*a, **k):
        wait()
        if calls[0] == untimed:
            started[0] = time.perf_counter()
        if calls[0] == untimed + tokens:
            raise EnoughTokens
        calls[0] += 1
        return sample_tokens(*a, **k)

    decoder.sample_tokens = counting
    try:
        for _ in model.generate_raw_image_stream("a caption", seed=1, grid_size=grid):
            pass
    except EnoughTokens:
        pass
    finally:
        del decoder.sample_tokens  # the class's own again
    return time.perf_counter() - started[0]


def whole_grids(model, grid, wait):
    """Seconds of a first and a second grid, caption to pixels on the host."""
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        for image in model.generate_raw_image_stream("a caption", seed=1, grid_size=grid):
            image.cpu()
        wait()
        seconds.append(time.perf_counter() - start)
    return {"seconds_first_grid": seconds[0], "seconds_per_grid": seconds[1]}

main()

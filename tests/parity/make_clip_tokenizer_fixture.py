"""Parity fixture for CLIP's caption tokenizer (src/text/clip_tokenizer.cpp) against
open_clip's `SimpleTokenizer` (PyPI `open-clip-torch` 3.3.0, the environment that
make_clip_fixture.py describes):
    ~/.cache/dalle/clip-venv/bin/python tests/parity/make_clip_tokenizer_fixture.py

The real merges file (bpe_simple_vocab_16e6.txt.gz, inside the open_clip package) is not
ours to commit, so the fixture carries a small merges file of its own, learnt here by plain
BPE over a few sentences, and open_clip's ids for a set of texts under it
(tests/fixtures/clip_bpe_test.txt.gz, tests/fixtures/clip_tokenizer.json). The ids under
the real file are stored too; the C++ test checks them when DALLE_CLIP_BPE names that file
(or the clip venv above holds it).
"""
import collections
import gzip
import json
import pathlib

import open_clip
from open_clip.tokenizer import SimpleTokenizer, bytes_to_unicode, default_bpe

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures"

CORPUS = """a red sandal on the right. a white trouser on the left. a green ankle boot at the top.
a yellow bag on the left and a blue sneaker on the right. the cat's hat isn't there; we'll see.
colours: red, green, blue, cyan, purple, orange, white, yellow. 12 items, 3 rows, 2024 pictures!
don't stop the music. they're here and you've been there. i'm sure he'd say so."""

TEXTS = [
    "a red sandal on the right",
    "A Yellow BAG on the left   and a blue sneaker\ton the right",
    "the cat's hat isn't there; we'll see, they're here!",
    "don't!!! stop...the music?? (12 items, 2024 pictures)",
    "x''s and ''quotes'' &amp; more &amp;amp; html &lt;b&gt; &#39;tags&#39; &#x41;",
    "\u2018curly\u2019 \u201cquotes\u201d stay straight",
    "caf\u00e9 na\u00efve \u00fcber \u00c9COLE stra\u00dfe",
    "\u732b\u306e\u5199\u771f and \u0444\u043e\u0442\u043e \u043a\u043e\u0448\u043a\u0438",
    "emoji \U0001F600\U0001F455 and symbols #%$ \u00a7 \u20ac5",
    "   leading and trailing spaces   ",
    "",
    "a purple ankle boot on the right " * 6,
]
CONTEXT = 16


def learn_merges(text, count):
    byte_symbol = bytes_to_unicode()
    words = collections.Counter(text.lower().split())
    vocab = {tuple(byte_symbol[b] for b in w.encode("utf-8"))[:-1]
             + (byte_symbol[w.encode("utf-8")[-1]] + "</w>",): n for w, n in words.items()}
    merges = []
    for _ in range(count):
        pairs = collections.Counter()
        for word, n in vocab.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda p: pairs[p])
        merges.append(best)
        merged = {}
        for word, n in vocab.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = n
        vocab = merged
    return merges


def ids_for(tokenizer):
    return {"encode": [tokenizer.encode(t) for t in TEXTS],
            "tokenize": [tokenizer([t], context_length=CONTEXT)[0].tolist() for t in TEXTS]}


merges = learn_merges(CORPUS, 300)
# No newline after the last merge: open_clip would read the empty last line as a merge.
content = "#version: dalle test\n" + "\n".join(f"{a} {b}" for a, b in merges)
with gzip.GzipFile(FIXTURES / "clip_bpe_test.txt.gz", "wb", mtime=0) as f:
    f.write(content.encode("utf-8"))
small = SimpleTokenizer(str(FIXTURES / "clip_bpe_test.txt.gz"))
real = SimpleTokenizer(default_bpe())
fixture = {"open_clip": open_clip.__version__, "texts": TEXTS, "context_length": CONTEXT,
           "test_merges": {"vocab_size": small.vocab_size, "start": small.sot_token_id, "end": small.eot_token_id,
                           **ids_for(small)},
           "real_merges": {"vocab_size": real.vocab_size, "start": real.sot_token_id, "end": real.eot_token_id,
                           **ids_for(real)}}
(FIXTURES / "clip_tokenizer.json").write_text(json.dumps(fixture, ensure_ascii=True, indent=1) + "\n")
print(f"{len(merges)} merges; vocab {small.vocab_size}; real vocab {real.vocab_size}")

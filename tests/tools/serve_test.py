#!/usr/bin/env python3
"""Serve: dalle-serve with the demo models (models/fashion-compose), driven as its users will.

Usage: serve_test.py SOURCE_DIR TOOLS_DIR  (ctest runs it with the project's venv, which has
the pinned `openai` package)

- OpenAI's own client generates (b64_json and url); the PNGs have the asked size and carry
  their settings in the "dalle" text chunk, and they are dalle-generate's images for the same
  prompt and seed; requests sent together are batched and draw what each draws alone.
- Every error path (malformed JSON, wrong types, a 10 MB body, a chunked body over the limit,
  n=0 and huge, an unknown model, a wrong or missing key, an unknown URL, a known URL with
  the wrong method (405 with Allow), control characters in the prompt) is an OpenAI-style
  JSON error with its status, and the server still serves afterwards.
- OpenAI's `images.edit` (POST /v1/images/edits): the mask's opaque top rows are the image
  prompt, and the images are dalle-generate's with the same image prompt and seed; masks the
  prior cannot honour, missing, unreadable and oversized images get OpenAI-style errors.
- `stream: true` with `partial_images` answers as server-sent events that OpenAI's client
  reads: the partial images of each candidate as it is drawn, then the image, which is the
  one the same request draws unstreamed.
- Named adapters (--adapter NAME=FILE): /v1/models lists them, a request chooses them with
  weights (OpenAI's client, extra_body) and draws dalle-generate's image with --adapter
  FILE:WEIGHT, alone or batched with requests choosing others or none.
- The web page (its script run by node) submits a job, and a reload finds it and shows its images.
- A job (POST /v1/images/jobs) outlives its connection: fetched by id once done, it holds the
  synchronous answer's images; a cancelled one frees its place in the queue.
- A full queue answers 429 at once; a client that leaves frees its place in the queue.
- SIGTERM drains: a new request gets 503, those in flight get their images, exit status 0.

Each server listens on 127.0.0.1 at a free port (port 0, read from its log). Every HTTP call
has a timeout and the whole test an alarm, so a hung server fails the test instead of
hanging it; servers are killed on the way out.
"""
import base64
import concurrent.futures
import http.client
import json
import os
import pathlib
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib

import openai

SOURCE, TOOLS = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
sys.path.insert(0, str(SOURCE / "scripts"))
from serve_process import ServeProcess, write_random_adapter  # noqa: E402
MODEL = SOURCE / "models" / "fashion-compose"
MODEL_ID = "fashion-compose"
KEY = "test-key-0123456789"
CALL_TIMEOUT = 120  # seconds, any one HTTP call
PROMPT = "a red sandal on the right"
# Few candidates and no super-resolution, unless a test needs them: the test stays quick.
QUICK = {"candidates": 2, "superres": False}


def fail(message):
    sys.exit(f"FAILED: {message}")


def check(condition, message):
    if not condition:
        fail(message)


class Server(ServeProcess):
    """dalle-serve with the demo models, one torch thread."""

    def __init__(self, *arguments):
        try:
            super().__init__(TOOLS, ["--model", MODEL, "--threads", "1", *arguments])
        except RuntimeError as error:
            fail(str(error))


def call(server, method, path, body=None, headers=None, key=KEY):
    """(status, parsed JSON or raw bytes) of one HTTP call."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT) as response:
            status, payload, kind = response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as error:
        status, payload, kind = error.code, error.read(), error.headers.get("Content-Type", "")
    return status, json.loads(payload) if kind.startswith("application/json") else payload


def generate(server, fields, key=KEY):
    return call(server, "POST", "/v1/images/generations", fields, key=key)


def expect_error(server, what, answer, status, code=None, param=None):
    got_status, body = answer
    check(got_status == status, f"{what}: status {got_status}, expected {status}: {body}")
    check(isinstance(body, dict) and set(body) == {"error"}, f"{what}: not an OpenAI error body: {body}")
    error = body["error"]
    check(set(error) == {"message", "type", "param", "code"} and error["message"], f"{what}: error fields {error}")
    if code is not None:
        check(error["code"] == code, f"{what}: code {error['code']}, expected {code}")
    if param is not None:
        check(error["param"] == param, f"{what}: param {error['param']}, expected {param}")
    return error


def png_chunks(png):
    """[(type, data)] of a PNG, checking its signature and every CRC."""
    check(png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG")
    chunks, at = [], 8
    while at < len(png):
        length, kind = struct.unpack(">I4s", png[at:at + 8])
        data = png[at + 8:at + 8 + length]
        (crc,) = struct.unpack(">I", png[at + 8 + length:at + 12 + length])
        check(zlib.crc32(kind + data) == crc, f"bad CRC in {kind}")
        chunks.append((kind.decode(), data))
        at += 12 + length
    return chunks


def png_facts(png):
    """(width, height, the "dalle" iTXt chunk's JSON, the pixels' compressed stream)."""
    chunks = png_chunks(png)
    width, height = struct.unpack(">II", chunks[0][1][:8])
    settings = None
    for kind, data in chunks:
        if kind == "iTXt" and data.startswith(b"dalle\0"):
            # keyword, 0, compression flag 0, method, language "", 0, translated "", 0, text
            check(data[6:7] == b"\0", "compressed text chunk")
            settings = json.loads(data[len(b"dalle\0\0\0\0\0"):].decode())
    pixels = b"".join(data for kind, data in chunks if kind == "IDAT")
    return width, height, settings, zlib.decompress(pixels)


def generated_by_dalle_generate(out, seed, candidates, n, superres, extra=()):
    """dalle-generate's PNGs for PROMPT with these settings, in rank order."""
    command = [TOOLS / "dalle-generate", PROMPT, "--model", MODEL, "--out", out, "--candidates", candidates, "-n", n,
               "--seed", seed, "--threads", "1", *extra]
    if not superres:
        command += ["--set", 'superres=""']
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=300)
    check(result.returncode == 0, f"dalle-generate failed: {result.stdout}{result.stderr}")
    return [(pathlib.Path(out) / f"0000-{rank:02d}.png").read_bytes() for rank in range(n)]


def test_openai_client(server, scratch):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=CALL_TIMEOUT)
    check([model.id for model in client.models.list()] == [MODEL_ID], "GET /v1/models lists the served model")
    answer = client.images.generate(model=MODEL_ID, prompt=PROMPT, n=2, size="64x64", response_format="b64_json",
                                    extra_body={"seed": 7, "candidates": 2})
    check(abs(answer.created - time.time()) < 600, f"created {answer.created}")
    check(len(answer.data) == 2, f"{len(answer.data)} images for n=2")
    pngs = [base64.b64decode(image.b64_json) for image in answer.data]
    expected = generated_by_dalle_generate(scratch / "generate", seed=7, candidates=2, n=2, superres=False)
    for rank, (png, reference) in enumerate(zip(pngs, expected)):
        check(answer.data[rank].revised_prompt is None, "no revised_prompt")
        width, height, settings, pixels = png_facts(png)
        check((width, height) == (64, 64), f"image {rank} is {width}x{height}, asked 64x64")
        check(settings is not None, f"image {rank} has no dalle text chunk")
        check(settings["prompt"] == PROMPT and settings["seed"] == 7 and settings["rank"] == rank,
              f"image {rank}'s settings: {settings}")
        check(settings["pipeline"]["candidates"] == "2" and settings["pipeline"]["keep"] == "2"
              and settings["pipeline"]["superres"] == "", f"image {rank}'s pipeline settings: {settings['pipeline']}")
        _, _, reference_settings, reference_pixels = png_facts(reference)
        check(pixels == reference_pixels, f"image {rank} differs from dalle-generate's with the same prompt and seed")
        check(settings == reference_settings, f"image {rank}'s settings differ from dalle-generate's:\n"
                                              f"{settings}\n{reference_settings}")
    # By URL, at the model's full size (with super-resolution).
    answer = client.images.generate(prompt=PROMPT, n=1, response_format="url", extra_body={"candidates": 2})
    url = answer.data[0].url
    check(url.startswith(server.url + "/v1/images/") and url.endswith(".png"), f"url {url}")
    with urllib.request.urlopen(url, timeout=CALL_TIMEOUT) as response:
        check(response.headers["Content-Type"] == "image/png", "an image/png")
        width, height, settings, _ = png_facts(response.read())
    check((width, height) == (128, 128) and settings["pipeline"]["superres"].endswith("superres"),
          f"the URL's image is {width}x{height}")
    expect_error(server, "an unknown image id", call(server, "GET", "/v1/images/" + "0" * 32 + ".png"), 404)
    # OpenAI's client raises its own exception types for the errors.
    for bad, exception in (({"model": "dall-e-3"}, openai.NotFoundError), ({"size": "1024x1024"}, openai.BadRequestError)):
        try:
            client.images.generate(prompt=PROMPT, **bad)
            fail(f"{bad} was accepted")
        except exception:
            pass
    try:
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).images.generate(prompt=PROMPT)
        fail("a wrong key was accepted")
    except openai.AuthenticationError:
        pass



def test_adapters(server, scratch, adapter):
    """A request chooses the server's named adapters (--adapter sneaker=FILE) with OpenAI's client
    (extra_body); its image is dalle-generate's with --adapter FILE:WEIGHT, batched or not."""
    status, models = call(server, "GET", "/v1/models")
    check(status == 200 and models["data"][0]["adapters"] == ["sneaker"], f"/v1/models lists the adapters: {models}")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=CALL_TIMEOUT)

    def png_of(adapters):
        answer = client.images.generate(prompt=PROMPT, n=1, size="64x64", response_format="b64_json",
                                        extra_body={"seed": 7, "candidates": 2, **({"adapters": adapters} if adapters
                                                                                    else {})})
        return base64.b64decode(answer.data[0].b64_json)

    adapted = png_facts(png_of({"sneaker": 0.75}))
    reference = png_facts(generated_by_dalle_generate(scratch / "adapted", seed=7, candidates=2, n=1, superres=False,
                                                      extra=("--adapter", f"{adapter}:0.75"))[0])
    check(adapted[3] == reference[3], "an adapted image differs from dalle-generate's with --adapter FILE:0.75")
    check(adapted[2] == reference[2], f"its settings differ from dalle-generate's:\n{adapted[2]}\n{reference[2]}")
    check(f"{adapter}:0.75" in str(adapted[2]["pipeline"]["adapters"]), f"the sidecar names the adapter: {adapted[2]}")
    plain = png_facts(png_of(None))
    check(plain[3] != adapted[3], "the adapter changes nothing")
    # Sent together (one batch window), each draws what it draws alone: the adapted request in a
    # batch of its own, the base restored for the other.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        mixed = list(pool.map(png_of, [None, {"sneaker": 0.75}, ["sneaker"], None]))
    check(png_facts(mixed[0])[3] == plain[3] and png_facts(mixed[3])[3] == plain[3], "the base changed in a mix")
    check(png_facts(mixed[1])[3] == adapted[3], "an adapted image changed in a mix")
    check(png_facts(mixed[2])[3] not in (plain[3], adapted[3]), "weight 1 draws what 0.75 or none draws")
    for bad, code in (({"style": 1}, "invalid_value"), ("sneaker", "invalid_type"), ({"sneaker": 11}, "invalid_value"),
                      ({"sneaker": "1"}, "invalid_type")):
        param = "adapters.sneaker" if isinstance(bad, dict) and "sneaker" in bad else "adapters"
        expect_error(server, f"adapters {bad}", generate(server, {"prompt": PROMPT, "adapters": bad}), 400, code, param)


def rgba_png(width, height, alpha_of_row):
    """A grey RGBA PNG whose pixel rows have the alpha alpha_of_row(y) (standard library only)."""
    rows = b"".join(b"\0" + bytes([128, 128, 128, alpha_of_row(y)]) * width for y in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def post_form(server, fields, files):
    """(status, JSON) of a multipart POST /v1/images/edits: fields {name: text}, files {name: bytes}."""
    boundary = "dalle-serve-test-boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
             for name, value in fields.items()]
    parts += [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{name}.png"\r\n'
              f"Content-Type: image/png\r\n\r\n".encode() + data + b"\r\n" for name, data in files.items()]
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return call(server, "POST", "/v1/images/edits", body, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})


def test_edits(server, scratch):
    """OpenAI's images.edit: the mask's opaque top rows are the image prompt; the images are
    dalle-generate's with the same image prompt and seed."""
    image = generated_by_dalle_generate(scratch / "edit-source", seed=3, candidates=1, n=1, superres=False)[0]
    (scratch / "image.png").write_bytes(image)
    # 64 pixels, 16 token rows of 4: the top 6 rows (24 pixels) kept, the rest drawn.
    (scratch / "mask.png").write_bytes(rgba_png(64, 64, lambda y: 255 if y < 24 else 0))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=CALL_TIMEOUT)
    with open(scratch / "image.png", "rb") as image_file, open(scratch / "mask.png", "rb") as mask_file:
        answer = client.images.edit(image=image_file, mask=mask_file, prompt=PROMPT, n=1, size="64x64",
                                    response_format="b64_json", extra_body={"seed": 9, "candidates": 2})
    check(len(answer.data) == 1, f"{len(answer.data)} images for an edit of n=1")
    edited = png_facts(base64.b64decode(answer.data[0].b64_json))
    check(edited[2]["pipeline"]["image_prompt.top_rows"] == "6", f"the edit's settings: {edited[2]['pipeline']}")
    expected = generated_by_dalle_generate(scratch / "edit-generate", seed=9, candidates=2, n=1, superres=False,
                                           extra=["--image-prompt", scratch / "image.png", "--image-prompt-rows", "6"])[0]
    check(edited[3] == png_facts(expected)[3], "an edit differs from dalle-generate's with the same image prompt and seed")
    # The image's own transparency is the mask when none is sent.
    status, body = post_form(server, {"prompt": PROMPT, "seed": "9", "candidates": "2", "size": "64x64",
                                      "response_format": "b64_json"},
                             {"image": rgba_png(64, 64, lambda y: 255 if y < 24 else 0)})
    check(status == 200 and len(body["data"]) == 1, f"an image with transparency and no mask: {status} {body}")
    hole = rgba_png(64, 64, lambda y: 0 if 24 <= y < 40 else 255)
    error = expect_error(server, "a mask with a hole in the middle", post_form(server, {"prompt": PROMPT},
                         {"image": image, "mask": hole}), 400, "invalid_mask", "mask")
    check("whole token rows from the top" in error["message"], f"which masks work: {error['message']}")
    expect_error(server, "an edit without an image", post_form(server, {"prompt": PROMPT}, {}), 400,
                 "missing_required_parameter", "image")
    expect_error(server, "an RGB image without a mask", post_form(server, {"prompt": PROMPT}, {"image": image}), 400,
                 "invalid_mask", "image")
    expect_error(server, "a text file as the image", post_form(server, {"prompt": PROMPT}, {"image": b"not an image"}),
                 400, "invalid_image_format", "image")
    expect_error(server, "an image over max_image_bytes",
                 post_form(server, {"prompt": PROMPT}, {"image": b"\x89PNG\r\n\x1a\n" + b"\0" * (5 << 20)}), 413,
                 "request_too_large", "image")
    expect_error(server, "an edit with a JSON body", call(server, "POST", "/v1/images/edits", {"prompt": PROMPT}), 400,
                 "invalid_content_type")
    expect_error(server, "n a word", post_form(server, {"prompt": PROMPT, "n": "two"}, {"image": image, "mask": hole}),
                 400, "invalid_type", "n")


def test_streaming(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=CALL_TIMEOUT)
    fields = {"prompt": PROMPT, "n": 1, "size": "64x64"}
    events = list(client.images.generate(**fields, stream=True, partial_images=3, extra_body={"seed": 5, **QUICK}))
    partial = [event for event in events if event.type == "image_generation.partial_image"]
    completed = [event for event in events if event.type == "image_generation.completed"]
    check(len(events) == len(partial) + len(completed), f"events of other types: {events}")
    # 64 positions, 3 partial images per returned image (OpenAI's count): after 16, 32 and 48
    # of them, of the first candidate (one image returned of two candidates).
    indices = [(event.model_extra["candidate"], event.partial_image_index) for event in partial]
    check(indices == [(0, i) for i in range(3)], f"partial images {indices}")
    # Ours: every candidate's, on request.
    every_candidate = {"seed": 5, "partial_images_of_every_candidate": True, **QUICK}
    every = [event for event in client.images.generate(**fields, stream=True, partial_images=3,
                                                       extra_body=every_candidate)
             if event.type == "image_generation.partial_image"]
    indices = sorted((event.model_extra["candidate"], event.partial_image_index) for event in every)
    check(indices == [(c, i) for c in (0, 1) for i in range(3)], f"every candidate's partial images {indices}")
    check(events.index(completed[0]) == len(events) - 1 and len(completed) == 1, "one image, last")
    partial_pngs = [base64.b64decode(event.b64_json) for event in partial]
    for png in partial_pngs:
        check(png_facts(png)[:2] == (64, 64), "a partial image of the image's size")
    check(len({png_facts(png)[3] for png in partial_pngs}) == len(partial_pngs), "each partial image shows more")
    unstreamed = client.images.generate(**fields, response_format="b64_json", extra_body={"seed": 5, **QUICK})
    check(png_facts(base64.b64decode(completed[0].b64_json))[3] == png_facts(base64.b64decode(unstreamed.data[0].b64_json))[3],
          "the streamed image is the one drawn without streaming")
    expect_error(server, "partial images unstreamed", generate(server, {"prompt": PROMPT, "partial_images": 2}), 400,
                 "invalid_value", "partial_images")
    expect_error(server, "4 partial images", generate(server, {"prompt": PROMPT, "stream": True, "partial_images": 4}),
                 400, "invalid_value", "partial_images")


def test_batching(server):
    """Requests sent together share generate calls and draw what each draws alone."""
    fields = [{"prompt": prompt, "seed": seed, "response_format": "b64_json", **QUICK}
              for prompt, seed in (("a red bag on the left", 1), ("a blue sneaker at the top", 2), (PROMPT, 3))]
    with concurrent.futures.ThreadPoolExecutor(len(fields)) as pool:
        together = list(pool.map(lambda body: generate(server, body), fields))
    alone = [generate(server, body) for body in fields]
    for (status, body), (alone_status, alone_body) in zip(together, alone):
        check(status == 200 and alone_status == 200, f"statuses {status}, {alone_status}: {body}")
        check(png_facts(base64.b64decode(body["data"][0]["b64_json"]))[3]
              == png_facts(base64.b64decode(alone_body["data"][0]["b64_json"]))[3],
              "a request batched with others draws what it draws alone")
    check(re.search(r"generated with [12] other requests", server.log()), f"no batch formed:\n{server.log()}")


def chunked_post(server, size):
    """Status of a POST whose body of `size` bytes is sent in chunks (no Content-Length)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CALL_TIMEOUT)
    chunks = (b"x" * 65536 for _ in range(size // 65536))
    try:
        connection.request("POST", "/v1/images/generations", body=chunks, encode_chunked=True,
                           headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    except (BrokenPipeError, ConnectionResetError):
        return None, None  # the server stopped reading: allowed, once it answered
    finally:
        connection.close()


def test_jobs(server):
    """A job outlives its connection: submitted, the connection dropped, fetched by id once done,
    it holds the images the synchronous answer has."""
    fields = {"prompt": PROMPT, "seed": 11, "response_format": "b64_json", **QUICK}
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CALL_TIMEOUT)
    connection.request("POST", "/v1/images/jobs", body=json.dumps(fields),
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = connection.getresponse()
    submitted = json.loads(response.read())
    connection.close()  # the client goes; the job goes on
    check(response.status == 202 and submitted["object"] == "image.job", f"submitting: {response.status} {submitted}")
    check(submitted["status"] in ("queued", "in_progress"), f"a new job's status: {submitted}")
    job_url = f"/v1/images/jobs/{submitted['id']}"
    check(response.getheader("Location") == job_url, f"Location {response.getheader('Location')}")
    deadline = time.time() + 120
    while True:
        status, job = call(server, "GET", job_url)
        check(status == 200 and job["id"] == submitted["id"], f"fetching the job: {status} {job}")
        if job["status"] not in ("queued", "in_progress") or time.time() > deadline:
            break
        time.sleep(0.05)
    check(job["status"] == "succeeded" and len(job["result"]["data"]) == 1, f"the job: {job}")
    item = job["result"]["data"][0]
    check(item["seed"] == 11 and item["candidate"] in (0, 1), f"an image's seed and candidate: {item.get('seed')}, "
          f"{item.get('candidate')}")
    status, direct = generate(server, fields)
    check(status == 200, f"the synchronous request: {status}")
    check(png_facts(base64.b64decode(job["result"]["data"][0]["b64_json"]))[3]
          == png_facts(base64.b64decode(direct["data"][0]["b64_json"]))[3],
          "a job's image is the synchronous answer's for the same request")
    check(call(server, "GET", job_url)[1]["status"] == "succeeded", "a finished job can be fetched again")
    expect_error(server, "an unknown job", call(server, "GET", "/v1/images/jobs/" + "0" * 32), 404, "job_not_found")
    expect_error(server, "a job without the key", call(server, "GET", job_url, key=None), 401, "invalid_api_key")
    expect_error(server, "a streamed job", call(server, "POST", "/v1/images/jobs", {"prompt": PROMPT, "stream": True}),
                 400, "invalid_value", "stream")
    # A job with partial_images shows the latest of each image while it runs.
    status, submitted = call(server, "POST", "/v1/images/jobs", {"prompt": PROMPT, "candidates": 64, "superres": False,
                                                                 "partial_images": 3, "response_format": "b64_json"})
    check(status == 202, f"a job with partial images: {status} {submitted}")
    partials, deadline = [], time.time() + 120
    while time.time() < deadline:
        job = call(server, "GET", f"/v1/images/jobs/{submitted['id']}")[1]
        partials += job.get("partial_images", [])
        if job["status"] not in ("queued", "in_progress"):
            break
        time.sleep(0.02)
    check(job["status"] == "succeeded" and "partial_images" not in job, f"the job with partial images: {job}")
    check(partials and all(p["candidate"] == 0 and 0 <= p["partial_image_index"] < 3
                           and png_facts(base64.b64decode(p["b64_json"]))[:2] == (64, 64) for p in partials),
          f"its partial images while it ran: {[(p['candidate'], p['partial_image_index']) for p in partials]}")


def test_errors(server):
    expect_error(server, "malformed JSON", generate(server, b'{"prompt": "a red'), 400, "invalid_json")
    expect_error(server, "not an object", generate(server, b'["a red bag"]'), 400, "invalid_json")
    expect_error(server, "no prompt", generate(server, {"n": 1}), 400, "missing_required_parameter", "prompt")
    expect_error(server, "prompt a number", generate(server, {"prompt": 3}), 400, "invalid_type", "prompt")
    expect_error(server, "n a string", generate(server, {"prompt": PROMPT, "n": "2"}), 400, "invalid_type", "n")
    expect_error(server, "superres a string", generate(server, {"prompt": PROMPT, "superres": "no"}), 400,
                 "invalid_type", "superres")
    expect_error(server, "n=0", generate(server, {"prompt": PROMPT, "n": 0}), 400, "invalid_value", "n")
    expect_error(server, "n huge", generate(server, {"prompt": PROMPT, "n": 10**12}), 400, "invalid_value", "n")
    expect_error(server, "a size it does not make", generate(server, {"prompt": PROMPT, "size": "256x256"}), 400,
                 "invalid_value", "size")
    expect_error(server, "a prompt too long", generate(server, {"prompt": "a" * 1001}), 400,
                 "string_above_max_length", "prompt")
    expect_error(server, "a 10 MB body", generate(server, b"{" + b" " * (10 << 20) + b"}"), 413, "request_too_large")
    status, body = chunked_post(server, 4 << 20)
    if status is not None:
        expect_error(server, "a chunked 4 MB body", (status, body), 413, "request_too_large")
    expect_error(server, "an unknown model", generate(server, {"prompt": PROMPT, "model": "dall-e-2"}), 404,
                 "model_not_found", "model")
    expect_error(server, "a wrong key", generate(server, {"prompt": PROMPT}, key="not-the-key"), 401,
                 "invalid_api_key")
    expect_error(server, "no key", generate(server, {"prompt": PROMPT}, key=None), 401, "invalid_api_key")
    expect_error(server, "no key for the model list", call(server, "GET", "/v1/models", key=None), 401)
    expect_error(server, "an unknown URL", call(server, "GET", "/v1/nothing"), 404)
    expect_error(server, "a URL of 3000 bytes", call(server, "GET", "/v1/images/" + "a" * 3000 + ".png"), 414,
                 "uri_too_long")
    # The key is checked from the headers: a client that waits for `100 Continue` before an
    # 8 MB body (under the limit) is refused at once, its body never asked for.
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.putrequest("POST", "/v1/images/generations")
    for name, value in (("Authorization", "Bearer not-the-key"), ("Content-Type", "application/json"),
                        ("Content-Length", str(8 << 20)), ("Expect", "100-continue")):
        connection.putheader(name, value)
    connection.endheaders()
    response = connection.getresponse()
    body = json.loads(response.read())
    connection.close()
    expect_error(server, "a wrong key before an 8 MB body", (response.status, body), 401, "invalid_api_key")
    for method, path, allowed in (("GET", "/v1/images/generations", "POST"), ("DELETE", "/health", "GET, HEAD"),
                                  ("POST", "/v1/models", "GET, HEAD")):
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CALL_TIMEOUT)
        connection.request(method, path, headers={"Authorization": f"Bearer {KEY}", "Content-Length": "0"})
        response = connection.getresponse()
        body = json.loads(response.read())
        connection.close()
        expect_error(server, f"{method} {path}", (response.status, body), 405, "method_not_allowed")
        check(response.getheader("Allow") == allowed, f"{method} {path}: Allow {response.getheader('Allow')}")
    for prompt, code in (("a red\x1b[2J sandal", "U+001B"), ("a red\x00 sandal", "U+0000")):
        error = expect_error(server, f"a prompt with {code}", generate(server, {"prompt": prompt}), 400,
                             "invalid_value", "prompt")
        check(f"control character ({code}" in error["message"], f"{code}: {error['message']}")
    # Still serving, with every answer counted.
    status, body = generate(server, {"prompt": PROMPT, "response_format": "b64_json", **QUICK})
    check(status == 200 and len(body["data"]) == 1, f"after the errors: {status} {body}")
    status, health = call(server, "GET", "/health", key=None)
    check(status == 200 and health["status"] == "ok", f"health {status} {health}")
    status, metrics = call(server, "GET", "/metrics", key=None)
    metrics = metrics.decode()
    for line in ('dalle_http_requests_total{endpoint="/v1/images/generations",status="400"}',
                 'dalle_http_requests_total{endpoint="/v1/images/generations",status="413"}',
                 'dalle_http_requests_total{endpoint="/v1/images/generations",status="401"}',
                 'dalle_http_requests_total{endpoint="/v1/images/generations",status="200"}',
                 "dalle_queue_depth 0", "dalle_images_generated_total", "dalle_images_per_second",
                 'dalle_image_request_seconds_bucket{le="+Inf"}', "dalle_image_request_seconds_count"):
        check(line in metrics, f"/metrics lacks {line}:\n{metrics}")
    status, page = call(server, "GET", "/", key=None)
    check(status == 200 and b"/v1/images/jobs" in page, "the web page")


def test_web_page(server):
    """The page's script, run by node against the server: a reload finds the job it submitted."""
    result = subprocess.run(["node", str(SOURCE / "tests" / "tools" / "web_page_test.js"), server.url, KEY],
                            capture_output=True, text=True, timeout=180)
    check(result.returncode == 0, f"the web page: {result.stdout}{result.stderr}")


def wait_for(server, what, condition, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        health = call(server, "GET", "/health", key=None)[1]
        if condition(health):
            return health
        time.sleep(0.02)
    fail(f"waited {seconds} s for {what}: {health}\n{server.log()}")


# Slow enough (about 2 s) to hold the model while the test queues others: 64 guided candidates.
SLOW = {"prompt": PROMPT, "candidates": 64, "superres": False, "response_format": "b64_json"}


def test_queue(server):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = pool.submit(generate, server, SLOW, None)
        wait_for(server, "the slow request to run", lambda health: health["generating"] == 1)
        # A client that leaves while queued frees its place.
        leaving = socket.create_connection(("127.0.0.1", server.port), timeout=CALL_TIMEOUT)
        body = json.dumps({"prompt": PROMPT, **QUICK}).encode()
        leaving.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(server, "the request to queue", lambda health: health["queued"] == 1)
        expect_error(server, "a full queue", generate(server, {"prompt": PROMPT, **QUICK}, key=None), 429,
                     "rate_limit_exceeded")
        leaving.close()
        wait_for(server, "the client that left to free its place", lambda health: health["queued"] == 0, 10)
        # So does a job cancelled while it waits.
        status, job = call(server, "POST", "/v1/images/jobs", {"prompt": PROMPT, **QUICK}, key=None)
        check(status == 202 and job["status"] == "queued" and job["queue_position"] == 0, f"a queued job: {job}")
        status, cancelled = call(server, "DELETE", f"/v1/images/jobs/{job['id']}", key=None)
        check(status == 200 and cancelled["status"] == "cancelled", f"cancelling: {status} {cancelled}")
        wait_for(server, "the cancelled job to free its place", lambda health: health["queued"] == 0, 10)
        check(call(server, "GET", f"/v1/images/jobs/{job['id']}", key=None)[1]["status"] == "cancelled",
              "a cancelled job stays cancelled")
        admitted = pool.submit(generate, server, {"prompt": PROMPT, **QUICK}, None)
        check(running.result(CALL_TIMEOUT)[0] == 200, "the slow request")
        check(admitted.result(CALL_TIMEOUT)[0] == 200, "the request admitted after the client left")
    check("a client left before its images were ready" in server.log(), f"no word of the client that left")


def test_drain(server):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(generate, server, SLOW, None)
        wait_for(server, "the slow request to run", lambda health: health["generating"] == 1)
        queued = pool.submit(generate, server, {"prompt": PROMPT, **QUICK}, None)
        wait_for(server, "a request to queue", lambda health: health["queued"] == 1)
        server.process.send_signal(signal.SIGTERM)
        wait_for(server, "draining", lambda health: health["status"] == "draining")
        # `timeout` and service managers may deliver SIGTERM twice: the drain goes on.
        server.process.send_signal(signal.SIGTERM)
        expect_error(server, "a request while draining", generate(server, {"prompt": PROMPT, **QUICK}, key=None),
                     503, "server_shutting_down")
        check(running.result(CALL_TIMEOUT)[0] == 200, "the running request is answered")
        check(queued.result(CALL_TIMEOUT)[0] == 200, "the queued request is answered")
    try:
        code = server.process.wait(60)
    except subprocess.TimeoutExpired:
        fail(f"dalle-serve did not exit after draining:\n{server.log()}")
    check(code == 0, f"dalle-serve exited {code} after SIGTERM:\n{server.log()}")


def test_deadline(server):
    """A request past request_timeout_seconds gets 504, a job fails; the server goes on serving."""
    expect_error(server, "a request past its deadline", generate(server, SLOW, key=None), 504, "timeout")
    health = wait_for(server, "the model to be free again", lambda health: health["generating"] == 0)
    check(health["status"] == "ok", f"health after a 504: {health}")
    check(call(server, "GET", "/v1/models", key=None)[0] == 200, "the server still answers after a 504")
    # A job has the same deadline: it ends failed, never in progress for ever.
    status, submitted = call(server, "POST", "/v1/images/jobs", SLOW, key=None)
    check(status == 202, f"submitting a slow job: {status} {submitted}")
    deadline = time.time() + 30
    while True:
        job = call(server, "GET", f"/v1/images/jobs/{submitted['id']}", key=None)[1]
        if job["status"] not in ("queued", "in_progress") or time.time() > deadline:
            break
        time.sleep(0.05)
    check(job["status"] == "failed" and job["error"]["code"] == "timeout", f"a job past its deadline: {job}")
    wait_for(server, "the model to be free after the job", lambda health: health["generating"] == 0)


def test_bad_command_lines():
    for arguments, message in ((["--model", MODEL, "--port", "70000"], "--port"),
                               (["--model", MODEL, "--set", "max_queue=0"], "max_queue"),
                               (["--model", MODEL, "--api-key-file", "/nonexistent/key"], "api_key_file")):
        result = subprocess.run([str(TOOLS / "dalle-serve"), *map(str, arguments)], capture_output=True, text=True,
                                timeout=120)
        check(result.returncode != 0 and message in result.stderr,
              f"{arguments}: exit {result.returncode}, {result.stderr}")
    result = subprocess.run([str(TOOLS / "dalle-serve"), "--help"], capture_output=True, text=True, timeout=60)
    check(result.returncode == 0 and "--api-key-file" in result.stdout, "--help")
    # The shipped config reads; it gives the pipeline, so --model may not.
    shipped = SOURCE / "configs" / "serve" / "fashion-compose.yaml"
    result = subprocess.run([str(TOOLS / "dalle-serve"), "--config", str(shipped), "--print-config"],
                            capture_output=True, text=True, timeout=60, cwd=SOURCE)
    check(result.returncode == 0 and "model_id: \"fashion-compose\"" in result.stdout, f"{shipped}: {result.stderr}")
    result = subprocess.run([str(TOOLS / "dalle-serve"), "--config", str(shipped), "--model", str(MODEL)],
                            capture_output=True, text=True, timeout=60)
    check(result.returncode == 2 and "both give the pipeline" in result.stderr, f"--config and --model: {result.stderr}")


def main():
    # A hung server fails the test here rather than holding ctest until its timeout.
    signal.signal(signal.SIGALRM, lambda *_: fail("the test took over 480 s: a server hung"))
    signal.alarm(480)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = pathlib.Path(scratch)
        (scratch / "key").write_text(KEY + "\n")
        test_bad_command_lines()
        adapter = write_random_adapter(MODEL / "prior" / "model.safetensors", scratch / "sneaker.safetensors")
        with Server("--api-key-file", scratch / "key", "--set", "batch_window_ms=300",
                    "--adapter", f"sneaker={adapter}") as server:
            test_openai_client(server, scratch)
            test_adapters(server, scratch, adapter)
            test_edits(server, scratch)
            test_streaming(server)
            test_batching(server)
            test_jobs(server)
            test_web_page(server)
            test_errors(server)
        with Server("--set", "max_queue=1", "--set", "batch_window_ms=0") as server:
            test_queue(server)
            test_drain(server)
        with Server("--set", "request_timeout_seconds=0.3", "--set", "batch_window_ms=0") as server:
            test_deadline(server)
    print("serve_test: all passed")


if __name__ == "__main__":
    main()

"""dalle-serve as a child process, for the serve test and the load benchmark (standard library only)."""
import json
import pathlib
import random
import re
import struct
import subprocess
import threading


def write_random_adapter(prior, path, rank=2, alpha=2.0, seed=5, spread=0.1):
    """A low-rank adapter file for the prior whose weights are the safetensors file `prior`, on
    its attention layers (qkv and out), its tensors drawn at random (normal, `spread` the standard
    deviation: enough to change every draw, not to make noise of it): the layout and metadata
    dalle-export --adapter writes. Returns `path`."""
    head = pathlib.Path(prior).read_bytes()
    (size,) = struct.unpack("<Q", head[:8])
    layers = {name[:-len(".weight")]: entry["shape"] for name, entry in json.loads(head[8:8 + size]).items()
              if name.endswith((".qkv.weight", ".out.weight"))}
    generator = random.Random(seed)
    tensors, data = {}, b""
    for layer, (out_features, in_features) in sorted(layers.items()):
        for name, shape in ((f"{layer}.lora_A.weight", [rank, in_features]),
                            (f"{layer}.lora_B.weight", [out_features, rank])):
            count = shape[0] * shape[1]
            tensors[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + 4 * count]}
            data += struct.pack(f"<{count}f", *(generator.gauss(0, spread) for _ in range(count)))
    tensors["__metadata__"] = {"format": "dalle-adapter", "rank": str(rank), "alpha": str(alpha), "base": "",
                               "family": "prior"}
    header = json.dumps(tensors).encode()
    header += b" " * (-len(header) % 8)
    pathlib.Path(path).write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


class ServeProcess:
    """dalle-serve on a free port of 127.0.0.1 (`--port 0`, the port read from its log); its
    log is kept for messages. Raises RuntimeError when it does not start within start_timeout."""

    def __init__(self, tools, arguments, cwd=None, start_timeout=120):
        self.command = [str(tools / "dalle-serve"), "--port", "0", *map(str, arguments)]
        self.process = subprocess.Popen(self.command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        self.lines, self.port = [], None
        found = threading.Event()

        def read_log():
            for line in self.process.stdout:
                self.lines.append(line)
                match = re.search(r"at http://127\.0\.0\.1:(\d+)/", line)
                if match and self.port is None:
                    self.port = int(match.group(1))
                    found.set()
            found.set()

        threading.Thread(target=read_log, daemon=True).start()
        if not found.wait(start_timeout) or self.port is None:
            self.kill()
            raise RuntimeError(f"dalle-serve did not start: {' '.join(self.command)}\n{self.log()}")
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self):
        return "".join(self.lines)

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        self.kill()

"""What the import tests share: the parity fixtures' weights as released files, and a runner."""
import subprocess
import sys

from safetensors.torch import load_file


def dequantized(path, prefix=""):
    """A parity fixture's weights under `prefix`: int8 values times their `:scale`."""
    stored = load_file(str(path))
    return {name[len(prefix):]: tensor.float() * stored[name + ":scale"] for name, tensor in stored.items()
            if name.startswith(prefix) and not name.endswith(":scale") and name + ":scale" in stored}


def run(command, expect_ok=True):
    """`command`'s result; the test fails, printing its output, unless it exits as expected."""
    result = subprocess.run([str(part) for part in command], text=True, capture_output=True, timeout=300)
    if (result.returncode == 0) != expect_ok:
        sys.exit(f"FAILED: {' '.join(map(str, command))} exited {result.returncode}\n{result.stdout}{result.stderr}")
    return result

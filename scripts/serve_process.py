"""dalle-serve as a child process, for the serve test and the load benchmark (standard library only)."""
import re
import subprocess
import threading


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

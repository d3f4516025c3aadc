"""Chat templates rendered in worker processes that a render's time limit can stop
(server/template_worker.py says why and how they render).

Each thread of the app's tokenizer pool has its own worker, started on its first chat template.
A render that runs past `timeout_s` kills its worker: the thread is free at once (nothing is left
spinning) and the next render starts a fresh one. A worker that dies is replaced the same way.
"""

import json
import os
import select
import subprocess
import sys
import threading
import time

WORKER = "optkit.server.template_worker"
STARTUP_TIMEOUT_S = 60.0  # a worker's start (Python, jinja) is not the template's time


class TemplateRejected(ValueError):
    """The template raised (raise_exception, a TemplateError): the messages do not fit it."""


class TemplateBudgetExceeded(ValueError):
    """The render ran past its time, its output size or its memory."""


class _Worker:
    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, "-m", WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )  # its stderr is the server's: a worker's own failure shows in the server's log
        try:
            ready = self.read_line(time.monotonic() + STARTUP_TIMEOUT_S)
        except EOFError:
            ready = None
        if ready is None:
            self.kill()
            raise RuntimeError(f"the chat template worker ({WORKER}) did not start")

    def send(self, request: bytes) -> None:
        self.process.stdin.write(request)
        self.process.stdin.flush()

    def read_line(self, deadline: float) -> bytes | None:
        """One line from the worker; None past `deadline`. EOFError when the worker is gone."""
        fd, data = self.process.stdout.fileno(), bytearray()
        poller = select.poll()  # not select(): a busy server's descriptors may pass FD_SETSIZE
        poller.register(fd, select.POLLIN)
        while not data.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            data += chunk
        return bytes(data)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:  # a broken pipe's unflushed bytes
                pass


class TemplateRenderer:
    """Renders with a time limit (`timeout_s`) and an output limit (`max_chars`) per render."""

    def __init__(self, timeout_s: float, max_chars: int):
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self._local = threading.local()
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False

    def render(self, template: str, messages: list[dict], variables: dict) -> str:
        request = {"template": template, "messages": messages, "variables": variables, "max_chars": self.max_chars}
        line = (json.dumps(request) + "\n").encode()
        for _ in range(2):  # once more with a fresh worker if the old one had died
            worker = self._worker()
            deadline = time.monotonic() + self.timeout_s
            try:
                worker.send(line)
                reply = worker.read_line(deadline)
            except (BrokenPipeError, EOFError):
                self._drop(worker)
                continue
            if reply is None:
                self._drop(worker)
                raise TemplateBudgetExceeded(
                    f"the model's chat template took over {self.timeout_s:g} s to render "
                    "(a loop that does not end?): fix the template in tokenizer_config.json"
                )
            answer = json.loads(reply)
            if "text" in answer:
                return answer["text"]
            if answer["kind"] == "memory":
                self._drop(worker)
            if answer["kind"] == "template":
                raise TemplateRejected(answer["error"])
            raise TemplateBudgetExceeded(f"{answer['error']}: fix the template in tokenizer_config.json")
        raise TemplateBudgetExceeded("the chat template's worker process died twice: see the server's log")

    def close(self) -> None:
        """Kill every worker; a render after this starts none."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, set()
        for worker in workers:
            worker.kill()

    def _worker(self) -> _Worker:
        worker = getattr(self._local, "worker", None)
        if worker is None or worker.process.poll() is not None:
            if worker is not None:  # it died between two renders
                self._drop(worker)
            worker = _Worker()  # not under the lock: a start takes a while, and other threads render meanwhile
            with self._lock:
                closed = self._closed
                if not closed:
                    self._workers.add(worker)
            if closed:
                worker.kill()
                raise TemplateBudgetExceeded("the server is shutting down")
            self._local.worker = worker
        return worker

    def _drop(self, worker: _Worker) -> None:
        with self._lock:
            self._workers.discard(worker)
        self._local.worker = None
        worker.kill()

"""Reads a child process's stdout line by line on a thread, so a test can
wait (with a deadline) for a line such as leapd's 'listening on ADDR'.
Shared by the Python tests that start leapd."""

import queue
import threading
import time


class StdoutLines:
    """Lines of `proc.stdout` (a text pipe), in order."""

    def __init__(self, proc, deadline_s):
        self._lines = queue.Queue()
        self._deadline_s = deadline_s
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc):
        for line in proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)  # EOF

    def wait_for(self, prefix):
        """Returns the rest of the first next line starting with `prefix`."""
        deadline = time.monotonic() + self._deadline_s
        seen = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no line starting with %r in %s s; got %r"
                                   % (prefix, self._deadline_s, seen))
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError("leapd exited before printing %r; got %r"
                                   % (prefix, seen))
            seen.append(line)
            if line.startswith(prefix):
                return line[len(prefix):]

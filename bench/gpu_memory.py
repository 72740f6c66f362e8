"""Peak GPU memory while a benchmark runs, polled from nvidia-smi (vLLM's benchmark does not record it)."""

from __future__ import annotations

import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from itertools import zip_longest


@dataclass
class GpuMemSampler:
    """Peak `memory.used` (MiB) per GPU, polled from nvidia-smi in a thread while in the `with`.

    Silently records nothing without nvidia-smi, or where it reports [N/A] (unified-memory GB10).
    """

    interval_s: float = 0.5
    command: str = "nvidia-smi"
    peak_mib: list[int] | None = None
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def __enter__(self) -> GpuMemSampler:
        if shutil.which(self.command):
            self._thread = threading.Thread(target=self._poll, name="gpu-mem", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    def _poll(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval_s):
                self._sample()  # one last reading at the end of the run
                return

    def _sample(self) -> None:
        try:
            out = subprocess.run([self.command, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return
        try:
            used = [int(float(v)) for v in out.split()]
        except ValueError:
            return  # "[N/A]" / "Not Supported"
        if used:
            old = self.peak_mib or [0] * len(used)
            self.peak_mib = [max(a, b) for a, b in zip_longest(old, used, fillvalue=0)]

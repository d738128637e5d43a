"""A GPU's used memory sampled over time: whole-process peaks, start-up included.

Two sources, one shape (peaks by phase, the samples with their times):

  DeviceSampler       a thread of this process reading cudaMemGetInfo
                      (total - free) every `interval` seconds: what
                      `caffeplus memory -gpu` measures its plans with
                      (caffeplus.memory.measure), where CuPy's allocation
                      hooks see the pool but not cuDNN's, cuBLAS's or the
                      CUDA context's own allocations.
  NvidiaSmiSampler    `nvidia-smi --query-gpu=memory.used -lms N` in a
                      subprocess: the device-side figure for a process we
                      start but do not run in (benchmarks/bench_budget_startup.py
                      watches `caffeplus train` with it).

Both report the device's used memory, every process on it: a figure for one
process assumes it has the GPU to itself (`baseline` is what was used
before it started, to subtract).
"""
import subprocess
import threading
import time

MiB = 2 ** 20


class _Sampler:
    """Peaks by phase over samples (seconds since start, bytes used)."""

    def __init__(self):
        self.samples = []
        self.peaks = {}
        self.phase = 'startup'
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def set_phase(self, name):
        """Later samples count towards phase `name`."""
        with self._lock:
            self.phase = name

    def add(self, used):
        with self._lock:
            self.samples.append((time.monotonic() - self._t0, int(used), self.phase))
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), int(used))

    def peak(self, *phases):
        """The highest sample of `phases` (every phase when none named); 0 if none."""
        with self._lock:
            return max([v for k, v in self.peaks.items() if not phases or k in phases] + [0])

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


class DeviceSampler(_Sampler):
    """cudaMemGetInfo on GPU `gpu` every `interval` seconds, in a thread."""

    def __init__(self, gpu, interval=0.01):
        super().__init__()
        self.gpu = gpu
        self.interval = interval
        self._stop = threading.Event()
        self._thread = None

    def _run(self):
        import cupy
        # This thread's current device: no context is made on another GPU.
        cupy.cuda.runtime.setDevice(self.gpu)
        while True:
            free, total = cupy.cuda.runtime.memGetInfo()
            self.add(total - free)
            if self._stop.wait(self.interval):
                break

    def start(self):
        self._thread = threading.Thread(target=self._run, name='device-memory-sampler',
                                        daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def nvidia_smi_command(gpu, interval_ms):
    return ['nvidia-smi', '--query-gpu=memory.used', '--format=csv,noheader,nounits',
            '-i', str(gpu), '-lms', str(int(interval_ms))]


def read_used_mib(gpu):
    """GPU `gpu`'s used memory now, in bytes (nvidia-smi's MiB figure)."""
    out = subprocess.run(nvidia_smi_command(gpu, 0)[:-2], capture_output=True, text=True,
                         check=True).stdout
    return int(out.strip().splitlines()[0]) * MiB


class NvidiaSmiSampler(_Sampler):
    """nvidia-smi's memory.used of GPU `gpu` every `interval_ms`, in a subprocess."""

    def __init__(self, gpu, interval_ms=100):
        super().__init__()
        self.gpu = gpu
        self.interval_ms = interval_ms
        self._proc = None
        self._reader = None

    def _read(self):
        for line in self._proc.stdout:
            line = line.strip()
            if line.isdigit():
                self.add(int(line) * MiB)

    def start(self):
        self._proc = subprocess.Popen(nvidia_smi_command(self.gpu, self.interval_ms),
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True)
        self._reader = threading.Thread(target=self._read, name='nvidia-smi-reader',
                                        daemon=True)
        self._reader.start()

    def wait_for_samples(self, count, deadline_s=30.0):
        """Until `count` samples have come (nvidia-smi's first takes a while)."""
        end = time.monotonic() + deadline_s
        while len(self.samples) < count and time.monotonic() < end:
            time.sleep(0.01)
        return len(self.samples) >= count

    def stop(self):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
        if self._reader is not None:
            self._reader.join()

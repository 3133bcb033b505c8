"""Where an expert computes, decided by measured latencies (Fiddler's rule), never by constants in code.

For an expert of width `bits` and shape (I, D), with S tokens routed to it:
- fused-int(S): the numba SwiGLU kernel on the packed weights with int8 activations
  (edgemoe.kernels.swiglu_expert_int); grows about linearly in S;
- dequant(S): dequantize the three matrices once (numba), then torch matmuls; about constant plus a
  small slope in S.
A short calibration times both at a few token counts on this machine and fits t = a + b*S per path
and width; the choice for S is the cheaper prediction. "fused-float" (float32 activations) is
never chosen: its slope measured twice the integer kernel's, and with a layer's experts in one
integer call (StoreExperts.layer_kernel) a per-expert path costs more again; a near tie of the
fits at one token once sent every INT8 expert of a fine-grained model to it, one call each, at
half the decode speed. It stays available as --compute fused-float.
Results are cached per machine and shape in the user cache directory ($EDGEMOE_CACHE_DIR, else
~/.cache/edgemoe/latency.json), so a machine calibrates once and every later run (and every tier) makes the same choice for the same S.
With a VRAM tier on a torch device, a third path is calibrated for experts held in RAM: "device",
copy the packed arrays to the device (measured seconds per byte) and dequantize + multiply there;
its cost is t = a + b*S plus the copy of the expert's bytes (Fiddler's CPU-vs-GPU rule). Experts
already resident on the device compute there; a layer's device experts share one copy of their rows
there and one back (StoreExperts), so the per-expert fit, which pays both, is an upper bound. Tested
with the CPU as a stand-in device, and on a CUDA GPU (docs/benchmarks.md, "On a GPU").
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .files import atomic_write

CALIBRATION_TOKENS = (1, 4, 16, 64)
PATHS = ("fused-int", "dequant")


def cache_file() -> Path:
    root = os.environ.get("EDGEMOE_CACHE_DIR") or Path.home() / ".cache" / "edgemoe"
    return Path(root) / "latency.json"


def machine_fingerprint() -> str:
    """What the timings depend on: CPU, cores we may use, library versions."""
    import numba

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    from edgemoe.kernels import default_int_path

    return (f"{cpu}|{cores} cores|torch {torch.__version__}|numba {numba.__version__}|threads "
            f"{torch.get_num_threads()}|int path {default_int_path()}")


@dataclass
class LatencyModel:
    """Fitted t = a + b*S (seconds) per path and width, for one expert shape on one machine."""

    fits: dict[str, dict[int, tuple[float, float]]]   # path -> bits -> (a, b)
    shape: tuple[int, int]                             # (I, D)
    machine: str
    device: str | None = None                          # the device path's torch device, if calibrated
    copy_seconds_per_byte: float = 0.0                 # host -> device

    def predict(self, path: str, bits: int, tokens: int, nbytes: int = 0) -> float:
        a, b = self.fits[path][bits]
        return a + b * tokens + (nbytes * self.copy_seconds_per_byte if path == "device" else 0.0)

    def choose(self, bits: int, tokens: int, nbytes: int = 0) -> str:
        """One of PATHS or (when calibrated) "device": the cheapest for this many tokens, for an
        expert of `nbytes` packed bytes held in RAM."""
        if bits not in self.fits[PATHS[0]]:
            raise KeyError(f"latency model has no calibration for INT{bits}")
        return min((p for p in self.fits if p in PATHS + ("device",)),
                   key=lambda p: self.predict(p, bits, tokens, nbytes))

    def crossover(self, bits: int) -> int | None:
        """The smallest token count for which dequantize + matmul wins, or None below 4096 tokens."""
        return next((s for s in range(1, 4097) if self.choose(bits, s) == "dequant"), None)

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "machine": self.machine, "device": self.device,
                "copy_seconds_per_byte": self.copy_seconds_per_byte,
                "fits": {p: {str(b): list(ab) for b, ab in per_bits.items()} for p, per_bits in self.fits.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "LatencyModel":
        fits = {p: {int(b): tuple(ab) for b, ab in per_bits.items()} for p, per_bits in d["fits"].items()}
        return cls(fits, tuple(d["shape"]), d["machine"], d.get("device"), d.get("copy_seconds_per_byte", 0.0))


def _call_times(fn, repeats: int) -> list[float]:
    """Wall times of `repeats` calls of fn, after one untimed call (warm-up, numba compilation)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_time(fn, repeats: int) -> float:
    """Median wall time of fn over `repeats` calls, after one untimed call."""
    return statistics.median(_call_times(fn, repeats))


def _fit(tokens, seconds) -> tuple[float, float]:
    """Least-squares line through (S, t), slope and intercept kept >= 0 (times never fall with S)."""
    b, a = np.polyfit(np.asarray(tokens, float), np.asarray(seconds, float), 1)
    b = max(float(b), 0.0)
    a = max(float(np.mean(seconds) - b * np.mean(tokens)), 0.0)
    return a, b


def fastest_time(fn, repeats: int) -> float:
    """The fastest wall time of fn over `repeats` calls, after one untimed call: contention (another
    process taking the core, a descheduled thread) only adds time, and one such call in a median of
    three made a kernel of 0.05 ms look like 5 ms in a calibration cached for good."""
    return min(_call_times(fn, repeats))


def calibrate(shape: tuple[int, int], widths, repeats: int = 5, tokens=CALIBRATION_TOKENS,
              device: str | None = None, gemm_dtype: torch.dtype = torch.float32) -> LatencyModel:
    """Time the paths on random weights of `shape` (I, D) at each width (and the device path when
    `device` is given); fit a line per path. gemm_dtype: what "dequant" dequantizes to and multiplies in."""
    from edgemoe import kernels
    from edgemoe.quant import quantize
    from edgemoe.kernels.device import expert_meta, swiglu_on_device, to_device

    from .layers import swiglu

    inner, dim = shape
    g = torch.Generator().manual_seed(0)
    paths = PATHS + (("device",) if device else ())
    fits: dict[str, dict[int, tuple[float, float]]] = {p: {} for p in paths}
    copy_per_byte = 0.0
    for bits in sorted(set(widths)):
        qts = {"gate": quantize(torch.randn(inner, dim, generator=g), bits),
               "up": quantize(torch.randn(inner, dim, generator=g), bits),
               "down": quantize(torch.randn(dim, inner, generator=g), bits)}
        measured = {p: [] for p in paths}
        for s in tokens:
            x = torch.randn(s, dim, generator=g)
            xn = x.numpy()
            measured["fused-int"].append(fastest_time(lambda: kernels.swiglu_expert_int(xn, *qts.values()), repeats))
            measured["dequant"].append(fastest_time(
                lambda: swiglu(x, *(kernels.dequantize(q, gemm_dtype) for q in qts.values())), repeats))
            if device:
                on_device = to_device(qts, torch.device(device))
                measured["device"].append(fastest_time(   # the input copied there, the result back
                    lambda: swiglu_on_device(x.to(device), expert_meta(qts), on_device).cpu(), repeats))
        for p in paths:
            fits[p][bits] = _fit(tokens, measured[p])
        if device:
            nbytes = sum(q.nbytes for q in qts.values())
            copy_per_byte = fastest_time(lambda: _synced(to_device(qts, torch.device(device))), repeats) / nbytes
    return LatencyModel(fits, (inner, dim), machine_fingerprint(), device, copy_per_byte)


def _synced(result):
    """Wait for the device's queued work (timings of asynchronous CUDA calls would stop early)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result


# Part of the cache key: a calibration made by an older method (medians, which one slow call could
# skew) is not reused.
CALIBRATION_METHOD = "fastest of 5"
# Changed whenever a kernel's speed changes the paths' balance, so that a calibration cached by an
# older edgemoe is not used (2: the integer kernel multiplies 4 prompt tokens per pass over a weight).
KERNEL_REVISION = 2


def _cache_key(shape, machine: str, device: str | None, gemm_dtype: torch.dtype = torch.float32) -> str:
    gemm = "" if gemm_dtype == torch.float32 else f"|dequant {str(gemm_dtype).removeprefix('torch.')}"
    return f"{machine}|{shape[0]}x{shape[1]}|{device or 'cpu only'}{gemm}|{CALIBRATION_METHOD}|kernels {KERNEL_REVISION}"


def load_or_calibrate(shape: tuple[int, int], widths, path: Path | None = None,
                      device: str | None = None, gemm_dtype: torch.dtype = torch.float32) -> LatencyModel:
    """The cached model for this machine, shape, device and dequant GEMM type if it covers `widths`,
    else a fresh calibration (cached)."""
    path = path or cache_file()
    machine = machine_fingerprint()
    key = _cache_key(shape, machine, device, gemm_dtype)
    try:
        cached = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        cached = {}
    if key in cached:
        model = LatencyModel.from_json(cached[key])
        if set(PATHS) <= set(model.fits):   # else an older edgemoe's calibration: redo it
            if set(widths) <= set(model.fits[PATHS[0]]):
                return model
            widths = set(widths) | set(model.fits[PATHS[0]])
    model = calibrate(shape, widths, device=device, gemm_dtype=gemm_dtype)
    cached[key] = model.to_json()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(cached, indent=1))
    except OSError:
        pass  # a read-only home: calibrate again next time, results unchanged
    return model

"""Samples a process's heap while it runs, for benchmarks/memory.py (on PYTHONPATH only for its runs).

glibc's bytes in use (mallinfo2: what live tensors and other objects hold) and the resident set, every
half millisecond from a daemon thread, in every process of a run (the ranks too: they start Python
afresh). The resident set counts more than the bytes in use: freed heap pages glibc keeps for reuse
(optimus.cpu_runtime.keep_cpu_allocations) and the libraries' code pages; the bytes in use are what
`optimus plan` models. At exit, writes `<pid>.json` to $OPTIMUS_HEAP_SAMPLES: the samples at the
largest bytes in use and at the largest resident set, and the first sample taken while the main thread
was in `build_model` (the trainer's "before the model" moment). Does nothing without that variable
or without glibc.
"""

import atexit
import ctypes
import json
import os
import sys
import threading
import time


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]  # fmt: skip


def _start(out_dir: str) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return
    main_id = threading.main_thread().ident
    found = {}

    def sample() -> dict:
        with open("/proc/self/status") as f:
            kib = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("VmRSS", "RssFile"))}
        rows = {name: 1024 * value for name, value in kib.items()}
        info = libc.mallinfo2()
        return {"rss": rows["VmRSS"], "file": rows["RssFile"], "in_use": info.uordblks + info.hblkhd}

    def building() -> bool:
        frame = sys._current_frames().get(main_id)
        while frame is not None:
            if frame.f_code.co_name == "build_model":
                return True
            frame = frame.f_back
        return False

    def run() -> None:
        while True:
            now = sample()
            if "before" not in found and building():
                found["before"] = now
            for key, field in (("at_peak_in_use", "in_use"), ("at_peak_rss", "rss")):
                if key not in found or now[field] > found[key][field]:
                    found[key] = now
            time.sleep(0.0005)

    def dump() -> None:
        if "before" in found:
            with open(os.path.join(out_dir, f"{os.getpid()}.json"), "w") as f:
                json.dump(found, f)

    threading.Thread(target=run, daemon=True).start()
    atexit.register(dump)


if os.environ.get("OPTIMUS_HEAP_SAMPLES"):
    _start(os.environ["OPTIMUS_HEAP_SAMPLES"])

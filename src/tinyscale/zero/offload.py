"""Offload: the ZeRO-Offload host tier and a ZeRO-Infinity style disk tier.

    swap = DiskSwapper("/mnt/nvme")                  # files in a fresh directory in there
    swap.add("unit0/master", master0)                # written out, its memory freed
    swap.prefetch(["unit1/master"])                  # read in on a thread
    with swap.resident(["unit0/master"]):            # waits for the read; in memory inside
        ...                                          # on exit: written back on a thread, freed

Ren et al., "ZeRO-Offload" (2021), sec. 4: fp32 master weights and optimizer states live
in host memory and the optimizer step runs on the CPU; the device keeps parameters and
gradients, sends gradient shards down and gets updated parameters back. Rajbhandari et
al., "ZeRO-Infinity" (2021), sec. 5-6: the same states (and parameters) in files on NVMe,
read ahead of their use by background I/O and written back behind it, so memory holds
only the few pieces in flight. Lesson: lessons/03-zero.md, "Offload". Tests: `pytest -k offload`.

**Host tier** (`offload_optimizer.device: cpu`): `host_device()` is the CPU; the sharded
optimizer keeps its master shards and states there and moves each gradient shard there
before the step (`ShardedOptimizer`). On a CPU-only machine the compute device *is* the
host, so the copies are no-ops: the code path is the same, the saving is not visible.

**Disk tier** (`device: nvme`): a `DiskSwapper` holds tensors whose bytes live in files.
Out of memory a tensor keeps its shape and dtype but its storage is resized to 0 bytes, so
every reference to it (the optimizer's state dict holds them) stays valid and is refilled
in place by a read. I/O runs on a thread pool (file reads and writes release the GIL).
Resident memory is bounded by what the caller keeps `resident` at once (the sharded
optimizer: the unit being stepped, the next one being read, the previous one being written).

Freed memory must go back to the operating system for resident memory (RSS) to drop.
glibc raises its mmap threshold after large blocks are freed, after which blocks of that
size come from the heap and stay in the process; `DiskSwapper` pins the threshold (see
`return_freed_memory_to_os`) so swapped-out buffers leave RSS.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def host_device() -> torch.device:
    """Where offloaded state lives: host memory, i.e. the CPU."""
    return torch.device("cpu")


def host_allocation(pin_memory: bool, has_gpu: bool) -> dict:
    """How the host tier allocates its buffers (DeepSpeed's ``offload_*.pin_memory``): pinned
    (page-locked) memory lets host<->GPU copies run by DMA, asynchronously and faster; without
    a GPU there is no such copy, so nothing is pinned. The seam tests call with `has_gpu`."""
    return {"device": host_device(), "pin_memory": pin_memory and has_gpu}


def to_host(t: torch.Tensor, pin_memory: bool = False) -> torch.Tensor:
    """A copy of `t` in host memory, pinned if asked and a GPU exists (`host_allocation`)."""
    out = torch.empty(t.shape, dtype=t.dtype, **host_allocation(pin_memory, torch.cuda.is_available()))
    return out.copy_(t)


def return_freed_memory_to_os() -> None:
    """Make glibc serve blocks >= 128 KiB with mmap, always, so freeing them unmaps them.

    By default glibc raises the threshold to the size of the largest block freed (up to
    32 MiB), so after the first swap-out, same-sized blocks come from the heap and freeing
    them leaves RSS unchanged. Setting M_MMAP_THRESHOLD disables that adjustment. Harmless
    where it does not apply (not glibc: the call is skipped).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 128 * 1024)


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes as a writable buffer (CPU, contiguous), for file I/O without copies.

    Through ctypes, not `t.numpy()`: sharing a storage with numpy makes it non-resizable
    for good, and swapping out is resizing the storage to 0 bytes."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


class DiskSwapper:
    """Tensors kept in files; in memory only while `resident` (or between swap_in and swap_out)."""

    def __init__(self, directory: str | os.PathLike | None = None, threads: int = 2):
        # A fresh directory per swapper (ranks and engines sharing one nvme_path never
        # collide), removed by close().
        try:
            if directory is not None:
                Path(directory).mkdir(parents=True, exist_ok=True)
            self.directory = Path(tempfile.mkdtemp(prefix="tinyscale-swap-", dir=directory))
        except OSError as exc:
            raise ValueError(f"offload nvme_path {str(directory)!r} cannot be used ({exc}); point "
                             "zero_optimization.offload_*.nvme_path at a writable directory") from exc
        return_freed_memory_to_os()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tinyscale-swap")
        self._tensors: dict[str, torch.Tensor] = {}
        self._io: dict[str, Future] = {}  # the read or write in flight for a key
        self._writing: set[str] = set()  # keys whose write may still hold their memory
        self._resident: set[str] = set()
        self._lock = threading.Lock()
        self.bytes_read = self.bytes_written = 0
        self.peak_resident_bytes = 0

    # --8<-- [start:swap]
    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Take `tensor` (CPU, contiguous) into the store: written to its file, then freed."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"DiskSwapper.add({key!r}): needs a contiguous CPU tensor, got {tensor.device} "
                             "(move it to host memory first: offload to disk goes through the host)")
        if key in self._tensors:
            raise ValueError(f"DiskSwapper.add: {key!r} is already stored")
        self._tensors[key] = tensor
        self._resident.add(key)
        self._note_resident()
        self.swap_out([key])

    def prefetch(self, keys: Iterable[str]) -> None:
        """Start reading `keys` back into memory on the I/O threads (no wait)."""
        for key in keys:
            if key in self._resident:
                continue
            t = self._tensors[key]
            self._wait(key)  # its write must land before we read the file
            t.untyped_storage().resize_(t.numel() * t.element_size())  # allocate, in this thread
            self._resident.add(key)
            self._note_resident()
            self._io[key] = self._pool.submit(self._read, key, t)

    def swap_in(self, keys: Iterable[str]) -> None:
        """Make `keys` resident (waiting for their prefetch, or reading them now)."""
        keys = list(keys)
        self.prefetch(keys)
        for key in keys:
            self._wait(key)

    def swap_out(self, keys: Iterable[str], write: bool = True) -> None:
        """Write `keys` back to their files on the I/O threads and free their memory after.

        `write=False` frees without writing (the file already holds these values)."""
        for key in keys:
            if key not in self._resident:
                continue
            self._wait(key)
            self._resident.discard(key)
            t = self._tensors[key]
            if write:
                self._writing.add(key)
                self._io[key] = self._pool.submit(self._write_and_free, key, t)
            else:
                t.untyped_storage().resize_(0)
    # --8<-- [end:swap]

    @contextlib.contextmanager
    def resident(self, keys: Iterable[str], write: bool = True) -> Iterator[None]:
        keys = list(keys)
        self.swap_in(keys)
        try:
            yield
        finally:
            self.swap_out(keys, write=write)

    def _read(self, key: str, t: torch.Tensor) -> None:
        with open(self._path(key), "rb") as f:
            n = f.readinto(_bytes_view(t))
        if n != t.numel() * t.element_size():
            raise OSError(f"DiskSwapper: {self._path(key)} is short ({n} bytes, expected "
                          f"{t.numel() * t.element_size()}); the swap directory was changed under us")
        with self._lock:
            self.bytes_read += n

    def _write_and_free(self, key: str, t: torch.Tensor) -> None:
        path = self._path(key)
        with open(path, "wb") as f:
            f.write(_bytes_view(t))
        with self._lock:
            self.bytes_written += t.numel() * t.element_size()
        t.untyped_storage().resize_(0)  # nobody touches it until the next swap_in waits for us

    def _wait(self, key: str) -> None:
        self._writing.discard(key)
        io = self._io.pop(key, None)
        if io is not None:
            io.result()  # re-raises an I/O error here, in the caller's thread

    def _path(self, key: str) -> Path:
        return self.directory / (key.replace("/", "__") + ".bin")

    def _note_resident(self) -> None:
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes())

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def resident_bytes(self) -> int:
        """Bytes in memory: resident keys and those whose write back has not finished."""
        writing = {k for k in self._writing if not self._io[k].done()}
        return sum(self._tensors[k].numel() * self._tensors[k].element_size() for k in self._resident | writing)

    def reset_peak(self) -> None:
        self.peak_resident_bytes = self.resident_bytes()

    def disk_bytes(self, keys: Iterable[str] | None = None) -> int:
        """Bytes of the stored tensors now out of memory (on disk only)."""
        keys = self._tensors if keys is None else keys
        return sum(self._tensors[k].numel() * self._tensors[k].element_size()
                   for k in keys if k in self._tensors and k not in self._resident)

    def wait(self, keys: Iterable[str]) -> None:
        """Wait for the reads and writes in flight for `keys` (a written key is then freed)."""
        for key in keys:
            self._wait(key)

    def flush(self) -> None:
        """Wait for every read and write in flight."""
        for key in list(self._io):
            self._wait(key)

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


class ParamShards:
    """Stage 3's parameter shards, one per unit: on the device, on the host, or on disk.

    The stage asks for a unit's shard when it all-gathers it (`source`), says when the
    gather is done with it (`release`), and writes the updated shard after the step
    (`write`); `read_ahead` starts a disk read early (ZeRO-Infinity's prefetch), so that a
    unit's `source` later finds its bytes already in memory.
    """

    def __init__(self, shards: list[torch.Tensor], device: torch.device, offload: str = "none",
                 nvme_path: str | None = None, pin_memory: bool = False):
        if offload not in OFFLOAD_DEVICES:
            raise ValueError(f"offload_param.device={offload!r}: choose one of {OFFLOAD_DEVICES}")
        self.device, self.offload = device, offload
        # host tier: pinned if asked (and a GPU exists); the disk tier resizes its buffers: pageable
        self.shards = [s.to(device, copy=True) if offload == "none" else to_host(s, pin_memory and offload == "cpu")
                       for s in shards]
        self.swap = DiskSwapper(nvme_path) if offload == "nvme" else None
        for i, s in enumerate(self.shards) if self.swap else ():
            self.swap.add(f"{i}/param", s)

    def source(self, i: int) -> torch.Tensor:
        """Shard i on the compute device, to all-gather from (keep it until `release(i)`)."""
        if self.swap is not None:
            self.swap.swap_in([f"{i}/param"])
        return self.shards[i].to(self.device)  # host -> device copy when offloaded to a GPU run

    def release(self, i: int) -> None:
        if self.swap is not None:
            self.swap.swap_out([f"{i}/param"], write=False)  # unchanged: the file has these bytes

    def read_ahead(self, i: int) -> None:
        if self.swap is not None:
            self.swap.prefetch([f"{i}/param"])

    def write(self, i: int, values: torch.Tensor) -> None:
        """Shard i := values (the updated master shard), wherever the shard lives."""
        if self.swap is None:
            self.shards[i].copy_(values)
            return
        self.swap.swap_in([f"{i}/param"])  # reads bytes about to be overwritten: simple, not optimal
        self.shards[i].copy_(values)
        self.swap.swap_out([f"{i}/param"])

    def resident(self) -> list[torch.Tensor]:
        """The shards that occupy memory now (for memory_report)."""
        return [s for s in self.shards if s.untyped_storage().nbytes()]

    def disk_bytes(self) -> int:
        return self.swap.disk_bytes() if self.swap is not None else 0

"""DeepSpeed in this process: where its ops are built, the op only inference needs kept from compiling, its comm
layer over the process group the runtime started (collectives looked up at call time, so telemetry sees them), and
glibc told to give freed blocks back under zero.Init. Imported only by the runs that use DeepSpeed."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

DEFAULT_EXTENSIONS_DIR = Path.home() / ".cache" / "dist_train" / "torch_extensions"


def use_extensions_cache() -> Path:
    """Build DeepSpeed's ops once per machine, whatever the entry point: one cache, one ninja.

    The cache is TORCH_EXTENSIONS_DIR if the user set it, else ~/.cache/dist_train/torch_extensions. The
    build tool is the `ninja` installed with this project (beside the Python that runs it), put first on
    PATH: torch's JIT build takes whichever `ninja` PATH finds first, and two ninja versions (Debian's 1.11
    for a non-activated `make test`, pip's 1.13 in an activated shell) read each other's build log as
    foreign and rebuild everything, which looked like a 30-60 s hang.
    """
    path = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(DEFAULT_EXTENSIONS_DIR)))
    path.mkdir(parents=True, exist_ok=True)
    ours = Path(sys.executable).parent
    search = os.environ.get("PATH", "").split(os.pathsep)
    if (ours / "ninja").is_file() and search[:1] != [str(ours)]:
        os.environ["PATH"] = os.pathsep.join([str(ours), *search])
    return path


def skip_inference_comm_op() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory all-reduce, which only inference uses.

    DeepSpeed's torch backend builds that op (`ShareMemCommBuilder`) as soon as it starts on a CPU accelerator:
    about 45 s of g++ on 2 cores, once per machine and extensions cache. Its only caller is
    `inference_all_reduce`; training's collectives go through torch.distributed. Marked incompatible, the op is
    not built (`deepspeed.comm.torch.build_shm_op` then returns None, as on a machine that cannot build it), and
    inference_all_reduce would fall back to torch's all_reduce."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def init_deepspeed_comm(backend: str | None) -> None:
    """Wrap the process group the runtime already started in `deepspeed.comm`.

    DeepSpeed's torch backend binds `dist.all_gather_into_tensor` / `dist.reduce_scatter_tensor` when it
    is built; rebinding them to late lookups means every collective goes through whatever
    `torch.distributed` exposes at call time (telemetry's wrappers, installed before or after).
    """
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    import torch.distributed as dist

    # DeepSpeed calls these torch names, not the user: their deprecation notice is noise in every run.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )
    deepspeed.init_distributed(dist_backend=backend, dist_init_required=False, verbose=False)
    cdb = ds_comm.cdb
    if cdb is not None and hasattr(cdb, "all_gather_function"):
        cdb.all_gather_function = lambda *a, **kw: dist.all_gather_into_tensor(*a, **kw)
        cdb.reduce_scatter_function = lambda *a, **kw: dist.reduce_scatter_tensor(*a, **kw)


def unmap_large_frees() -> None:
    """Have glibc give every freed block over 128 KiB back to the kernel at once, from now on in this process.

    Under zero.Init each module's tensors are made whole, then partitioned and freed. glibc raises its mmap
    threshold as large blocks are freed (up to 32 MiB), so later layers' tensors come from the heap, and freed heap
    memory stays resident: measured on 4 ranks of a 162M-parameter model, loading held 0.72 of the weights above the
    baseline instead of 0.42 (the rank's partition and one module). A fixed threshold (glibc's default value)
    turns the raising off. Nothing happens where the C library has no mallopt."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD (malloc.h)

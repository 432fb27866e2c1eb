"""Weights from a trainer process to the engine's: by handle, or by broadcast over a process group.

By handle (`/update_weights_from_tensor`), as SGLang's MultiprocessingSerializer does it: the
list of (hub name, tensor) pairs is pickled with multiprocessing's ForkingPickler, under
torch.multiprocessing's reducers, and the bytes go base64 in JSON. Only handles travel, never
the weights' bytes: a CUDA tensor goes as a CUDA IPC handle (the engine's process maps the
trainer's memory), a CPU tensor as the name of a shared-memory file. For CPU tensors torch's
default sharing strategy ("file_descriptor") would send a file descriptor over a socket that
only the sender's own multiprocessing children may connect to (its authkey), so an unrelated
process (the server) could not open it: `serialize` sends CPU storages by file name instead
(torch's "file_system" strategy, for this pickle only). Such a storage moves into shared memory
in place (`share_memory_`, as torch.multiprocessing does), so sending the same tensor again
costs no copy; the file goes when the last process holding it lets go. A pickled CPU handle
keeps its file alive until some process unpickles it: a payload the server rejects before any
rank read it (a bad base64 string, say) leaves its files until the trainer exits.

The bucketed form (SGLang's load_format "flattened_bucket") packs many small tensors into one:
a flat uint8 tensor of all their bytes and per tensor its name, shape, dtype and byte range.
One handle then carries hundreds of norms and biases. Buckets of SGLang's older layout (a flat
tensor of one dtype, ranges in elements) are read too.

Unpickling runs only what tensors need (`_Unpickler` lists it): a payload cannot make the server
run other code.

By broadcast (`/update_weights_from_distributed`): the trainer's rank 0 and every engine rank
join one process group, built from a TCPStore beside torch.distributed's default group (which
the server's mesh owns), and the trainer broadcasts each tensor in order. `init_trainer_group`
is the trainer's side, `join_group` the engine's.
"""

import base64
import binascii
import collections
import io
import pickle
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
from torch.multiprocessing import reductions  # importing it registers torch's reducers with ForkingPickler

LOAD_FORMATS = (None, "flattened_bucket")
GROUP_TIMEOUT = timedelta(minutes=10)  # a process group's wait for its peers (join, each broadcast)


@dataclass(frozen=True)
class FlattenedTensorMetadata:
    """One tensor of a bucket, with SGLang's field names (so its buckets unpickle as these)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int  # first byte of the flat tensor (an element index where it has the tensor's dtype)
    end_idx: int
    numel: int  # end_idx - start_idx


def serialize(obj) -> str:
    """obj (e.g. [(name, tensor), ...]) pickled with tensors by handle, as a base64 string for JSON."""
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize(data: str | bytes, what: str = "serialized_named_tensors"):
    """What `serialize` (or SGLang's MultiprocessingSerializer) made; a ValueError naming `what`
    for anything else."""
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{what}: not a base64 string ({e})") from None
    try:
        return _Unpickler(io.BytesIO(raw)).load()
    except ValueError:
        raise
    except Exception as e:  # a truncated pickle, a handle that no longer opens, ...
        raise ValueError(f"{what}: could not be unpickled ({type(e).__name__}: {e})") from None


def flatten(named: list[tuple[str, torch.Tensor]]) -> dict:
    """The bucketed form of (name, tensor) pairs, all on one device: {"flattened_tensor": uint8,
    "metadata": [FlattenedTensorMetadata, ...]}, what load_format="flattened_bucket" sends."""
    if not named:
        raise ValueError("flatten: no tensors; a bucket holds at least one")
    devices = {t.device for _, t in named}
    if len(devices) > 1:
        raise ValueError(f"flatten: the tensors are on {sorted(map(str, devices))}; a bucket's are on one device")
    parts, metadata, at = [], [], 0
    for name, t in named:
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        parts.append(flat)
        metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, at, at + flat.numel(), flat.numel()))
        at += flat.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


def unflatten(bucket) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a bucket (views of its flat tensor); a ValueError names a bad entry."""
    if not (isinstance(bucket, dict) and isinstance(bucket.get("flattened_tensor"), torch.Tensor)
            and isinstance(bucket.get("metadata"), (list, tuple))):
        raise ValueError(f"load_format 'flattened_bucket': got a {type(bucket).__name__}; expected a dict with "
                         "'flattened_tensor' (a tensor) and 'metadata' (a list)")
    flat = bucket["flattened_tensor"].reshape(-1)
    out = []
    for i, m in enumerate(bucket["metadata"]):
        name, shape, dtype = getattr(m, "name", None), getattr(m, "shape", None), getattr(m, "dtype", None)
        start, end = getattr(m, "start_idx", None), getattr(m, "end_idx", None)
        if not (isinstance(name, str) and isinstance(dtype, torch.dtype) and isinstance(start, int)
                and isinstance(end, int) and isinstance(shape, (tuple, list))):
            raise ValueError(f"flattened_bucket: metadata entry {i} is a {type(m).__name__}; expected name, "
                             "shape, dtype, start_idx and end_idx")
        count = torch.Size(shape).numel()
        if flat.dtype == dtype:  # one dtype per bucket (SGLang's older layout): ranges in elements
            want = count
        elif flat.dtype == torch.uint8:
            want = count * dtype.itemsize
        else:
            raise ValueError(f"flattened_bucket: {name!r} is {dtype} in a flat {flat.dtype} tensor; expected a "
                             f"uint8 flat tensor (or one of {dtype})")
        if not 0 <= start <= end <= flat.numel() or end - start != want:
            raise ValueError(f"flattened_bucket: {name!r} spans [{start}, {end}) of {flat.numel()}; its shape "
                             f"{list(shape)} of {dtype} needs {want}")
        part = flat[start:end]
        out.append((name, (part if flat.dtype == dtype else part.view(dtype)).view(shape)))
    return out


def named_tensors(obj, load_format: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs a payload holds: a list of pairs or a dict (load_format None),
    or a bucket ("flattened_bucket")."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: {load_format!r}; expected one of {list(LOAD_FORMATS)}")
    if load_format == "flattened_bucket":
        return unflatten(obj)
    if isinstance(obj, Mapping):
        return list(obj.items())
    if isinstance(obj, (str, bytes, torch.Tensor)) or not isinstance(obj, Iterable):
        raise ValueError(f"named_tensors: got a {type(obj).__name__}; expected (name, tensor) pairs")
    return list(obj)


def default_backend(on_cuda: bool) -> str:
    """The weight-update group's backend where none is named, on both sides: NCCL between GPUs, else gloo."""
    return "nccl" if on_cuda else "gloo"


def init_trainer_group(master_address: str, master_port: int, world_size: int, backend: str | None = None,
                       group_name: str = "weight_update_group", timeout: timedelta = GROUP_TIMEOUT):
    """The trainer's side of `/init_weights_update_group`: host the group's store at
    master_address:master_port and join as rank 0 (engine ranks are 1..world_size - 1). backend:
    None picks as the engine's side does, "nccl" where CUDA is available, else "gloo". Returns
    the process group (a torch ProcessGroupGloo / ProcessGroupNCCL, outside torch.distributed's
    default group); `broadcast(group, tensor)` sends over it. It returns once every engine rank
    has joined, so call the engine's init_weights_update_group in a thread meanwhile."""
    backend = backend or default_backend(torch.cuda.is_available())
    store = dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout,
                          wait_for_workers=False)
    return join_group(store, 0, world_size, backend, group_name, timeout)


def engine_store(master_address: str, master_port: int, world_size: int, timeout: timedelta = GROUP_TIMEOUT):
    """An engine rank's connection to the store the trainer hosts (init_trainer_group)."""
    return dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)


def join_group(store, rank: int, world_size: int, backend: str, group_name: str,
               timeout: timedelta = GROUP_TIMEOUT):
    """A process group of world_size ranks over `store` (keys under group_name), without touching
    torch.distributed's default group. Blocks until every rank joined."""
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    raise ValueError(f"backend: {backend!r}; expected 'gloo' (CPU) or 'nccl' (CUDA)")


def broadcast(group, tensor: torch.Tensor) -> None:
    """Broadcast tensor from rank 0 of a group made by init_trainer_group / join_group (in place
    on the other ranks); returns once it is done."""
    group.broadcast([tensor], dist.BroadcastOptions()).wait()


# ---- pickling by handle ----

def _storage_by_name(storage):
    """A CPU storage as its shared-memory file's name (torch's "file_system" strategy, whatever
    the process's own): any process of this user can open it, not only our children."""
    if storage.device.type != "cpu" or storage.nbytes() == 0:
        return reductions.reduce_storage(storage)
    metadata = storage._share_filename_cpu_()  # moves it into shared memory once; then a no-op
    storage._shared_incref()  # for the pickle in flight; the receiver's rebuild drops it
    return (reductions.rebuild_storage_filename, (type(storage),) + metadata)


class _Pickler(ForkingPickler):
    def __init__(self, file):
        super().__init__(file)
        self.dispatch_table[torch.UntypedStorage] = _storage_by_name


# what unpickling a tensor by handle needs, nothing else
_REBUILDERS = ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
               "rebuild_storage_filename", "rebuild_storage_empty")
_ALLOWED = {("torch.multiprocessing.reductions", n): getattr(reductions, n) for n in _REBUILDERS} | {
    ("torch", "Tensor"): torch.Tensor, ("torch", "Size"): torch.Size, ("torch", "device"): torch.device,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage, ("torch.storage", "TypedStorage"): torch.TypedStorage,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter, ("collections", "OrderedDict"): collections.OrderedDict,
    (__name__, "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name == "rebuild_storage_fd" or module.startswith("multiprocessing"):
            raise ValueError("serialized_named_tensors: a CPU tensor shared by file descriptor (torch's default "
                             "'file_descriptor' sharing strategy), which only the sender's own children can open; "
                             "serialise with mimo_fn.rl.transfer.serialize, or call torch.multiprocessing."
                             "set_sharing_strategy('file_system') before pickling")
        raise ValueError(f"serialized_named_tensors: the pickle names {module}.{name}; expected only (name, tensor) "
                         "pairs or a flattened bucket of tensors")

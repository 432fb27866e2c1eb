"""Autotune picks kept across processes: per GPU model and tuning key, in Triton's cache dir.

A Triton autotuner (triton.autotune) times every config of its list the first time a process
launches it with a new tuning key (the MoE GEMMs' key holds the dims, the block rows and the
token count's power-of-two bucket), so a fresh process pays seconds of tuning before its first
prefill. Triton can keep the timings on disk itself (triton.autotune(cache_results=True),
Triton 3.4 and later), but it gives up on any config list with a pre_hook, and every config of
the bf16 / FP8 MoE GEMMs has one (it sets the TMA boxes to the config's tile); and its key
names the GPU's architecture (sm_90), not the GPU, so an H100's picks would serve an H200.

`Persisted(tuner)` wraps an autotuner instead. Its first launch in a process reads the picks
stored for (the GPU's name, Triton's version, the kernel's source, the config list, the prune
function's source) into the tuner's own in-memory cache (Autotuner.cache: tuning key -> config),
where Triton's launch path finds them as if tuned in this process; a launch that adds a key
writes the picks back. A pick is stored as the index of its config in the tuner's list, so the
config comes back with its pre_hook. The file lives under TRITON_CACHE_DIR (Triton's cache
manager, which writes atomically), so clearing Triton's cache clears the picks too. Processes
that tune at once may each write their own picks: the last file wins, and a key it lacks is
tuned again by the next process that meets it.

options.autotune_cache (on by default; MIMO_FN_AUTOTUNE_CACHE=0 turns it off) is read at each
launch; off, the wrapper only launches the tuner.
"""

import hashlib
import inspect
import json

import torch
import triton
from triton.runtime.cache import get_cache_manager
from triton.runtime.jit import JITFunction

from mimo_fn import options


def _triton_key() -> str:
    """Triton's hash of its own installation where this version exposes it (its home moved
    between versions), else its version string."""
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):
        try:
            return __import__(module, fromlist=["triton_key"]).triton_key()
        except (ImportError, AttributeError):
            continue
    return triton.__version__

FILE_NAME = "mimo_fn_autotune_picks.json"
_PLAIN = (bool, int, float, str, type(None))  # what a tuning key holds that JSON gives back unchanged


def store_key(tuner, device_name: str) -> str:
    """What the stored picks depend on, hashed: the GPU's name, Triton's version, the kernel's
    source (JITFunction.cache_key), the tuning key's names, the configs and the prune function."""
    fn = tuner.fn
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    prune = getattr(tuner, "early_config_prune", None)
    try:
        prune_src = inspect.getsource(prune) if prune is not None else ""
    except (OSError, TypeError):  # defined where no source is kept
        prune_src = prune.__qualname__
    parts = [device_name, _triton_key(), fn.cache_key, str(tuner.keys), *map(str, tuner.configs), prune_src]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class Persisted:
    """An autotuner whose picks outlive the process (see the module docstring). Launched as the
    tuner is, `kernel[grid](*args, **meta)`; `tuner` is the wrapped triton Autotuner."""

    def __init__(self, tuner):
        self.tuner = tuner
        self._store = None  # Triton's cache manager for this tuner's picks, from the first launch

    def __getattr__(self, name):  # the tuner's own attributes (cache, configs, ...) read through
        return getattr(self.tuner, name)

    def __getitem__(self, grid):
        launch = self.tuner[grid]
        if not options.current().autotune_cache:
            return launch

        def run(*args, **kwargs):
            if self._store is None:
                self._store = get_cache_manager(store_key(self.tuner, torch.cuda.get_device_name()))
                for key, index in self._stored().items():
                    self.tuner.cache.setdefault(key, self.tuner.configs[index])
            known = len(self.tuner.cache)
            out = launch(*args, **kwargs)
            if len(self.tuner.cache) > known:  # tuned a new key
                self._save()
            return out

        return run

    def _stored(self) -> dict[tuple, int]:
        """The stored picks, tuning key -> config index; none where the file is missing or unreadable."""
        path = self._store.get_file(FILE_NAME)
        if path is None:
            return {}
        try:
            with open(path) as f:
                rows = json.load(f)
            return {tuple(key): index for key, index in rows
                    if isinstance(index, int) and 0 <= index < len(self.tuner.configs)}
        except (OSError, ValueError, TypeError):  # torn or foreign: tune again, and overwrite it
            return {}

    def _save(self) -> None:
        picks = self._stored()  # keep what other processes stored since this one read the file
        for key, config in self.tuner.cache.items():
            index = next((i for i, c in enumerate(self.tuner.configs) if c is config), None)
            if index is not None and all(isinstance(v, _PLAIN) for v in key):
                picks[key] = index
        self._store.put(json.dumps([[list(key), index] for key, index in picks.items()]), FILE_NAME, binary=False)


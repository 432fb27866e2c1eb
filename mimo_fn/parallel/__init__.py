"""Parallelism over one device mesh: `init_mesh` builds it (also `mimo_fn.init_mesh`); the
modules hold the collectives, sharding rules, DP-attention token split and EP dispatch."""

from mimo_fn.parallel.mesh import Mesh, init_mesh

__all__ = ["Mesh", "init_mesh"]

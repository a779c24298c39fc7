"""The logical 2-D mesh shapes of a pipeline submesh, and a placement of a list of
submeshes onto the devices. (The submesh shapes themselves, Alpa's 1 x 2^k inside a host
or n whole hosts, are `Cluster.submesh_shapes`.)"""
from __future__ import annotations

from typing import Sequence


def logical_mesh_shapes(submesh: tuple[int, int]) -> list[tuple[int, int]]:
    """The 2-D views (n / b, b) of a submesh of n devices whose second axis stays inside one
    host (b divides the devices per host), as in Alpa. Both axes are the ILP's to use: a
    tensor split over the first (inter-host) axis, or over both, is priced at inter-host
    bandwidth, so model parallelism spans hosts only where that wins."""
    hosts, per_host = submesh
    n = hosts * per_host
    return [(n // b, b) for b in range(per_host, 0, -1) if per_host % b == 0]


def assign_devices(shapes: Sequence[tuple[int, int]], num_hosts: int,
                   devices_per_host: int) -> list[list[int]]:
    """Device indices (host * devices_per_host + slot) for each submesh, covering the
    cluster exactly: whole-host submeshes first, then 1 x 2^k ones largest first into the
    lowest free aligned slot (always possible when host width is a power of two)."""
    M = devices_per_host
    total = sum(n * m for n, m in shapes)
    if total != num_hosts * M:
        raise ValueError(f"submeshes {list(shapes)} use {total} devices but the cluster has "
                         f"{num_hosts} x {M} = {num_hosts * M}")
    for n, m in shapes:
        if not ((n == 1 and m <= M and M % m == 0) or m == M):
            raise ValueError(f"submesh ({n}, {m}) is not 1 x k inside a host or n x {M} whole hosts")
    free = [[True] * M for _ in range(num_hosts)]
    out: list[list[int] | None] = [None] * len(shapes)
    host = 0
    for i, (n, m) in enumerate(shapes):
        if m == M and (n > 1 or m == M):
            out[i] = [h * M + j for h in range(host, host + n) for j in range(M)]
            for h in range(host, host + n):
                free[h] = [False] * M
            host += n
    order = sorted((i for i in range(len(shapes)) if out[i] is None), key=lambda i: -shapes[i][1])
    for i in order:
        m = shapes[i][1]
        placed = False
        for h in range(num_hosts):
            for start in range(0, M, m):
                if all(free[h][start:start + m]):
                    out[i] = [h * M + j for j in range(start, start + m)]
                    free[h][start:start + m] = [False] * m
                    placed = True
                    break
            if placed:
                break
        if not placed:
            raise ValueError(f"cannot place submeshes {list(shapes)} on {num_hosts} x {M} devices")
    return out  # type: ignore[return-value]

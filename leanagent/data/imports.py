"""Transitive import closure for every file at once, cycle-safe and linear in the import graph.

Files are numbered and each closure is a Python int used as a bitset: condensing strongly
connected components (Tarjan, iterative) turns any cycles into single nodes, and Tarjan emits
components callees-first, so one pass of ORs fills every closure. On mathlib (~5k files) that
is milliseconds, against seconds for a breadth-first walk per file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def strongly_connected_components(graph: Sequence[Sequence[int]]) -> list[list[int]]:
    """Tarjan's algorithm without recursion (mathlib import chains exceed Python's recursion limit).

    Components come out in reverse topological order: every component a node imports is emitted first.
    """
    n = len(graph)
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    stack: list[int] = []
    components: list[list[int]] = []
    counter = 0
    for root in range(n):
        if index[root] != -1:
            continue
        work: list[tuple[int, int]] = [(root, 0)]
        while work:
            node, k = work[-1]
            if k == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack[node] = True
            if k < len(graph[node]):
                work[-1] = (node, k + 1)
                nxt = graph[node][k]
                if index[nxt] == -1:
                    work.append((nxt, 0))
                elif on_stack[nxt]:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack[member] = False
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
    return components


def import_closures(paths: Sequence[str], imports: Mapping[str, Sequence[str]]) -> list[int]:
    """Bitset per file (bit k = paths[k]) of every file it reaches by imports, itself excluded."""
    number = {p: k for k, p in enumerate(paths)}
    graph = [[number[i] for i in imports.get(p, []) if i in number] for p in paths]
    component_of = [0] * len(paths)
    reach: list[int] = []
    for c, members in enumerate(strongly_connected_components(graph)):
        for m in members:
            component_of[m] = c
        bits = 0
        for m in members:
            for j in graph[m]:
                bits |= 1 << j
                if component_of[j] != c:  # an earlier component: its closure is final
                    bits |= reach[component_of[j]]
        reach.append(bits)
    return [reach[component_of[k]] & ~(1 << k) for k in range(len(paths))]


def bits_to_mask(bits: int, size: int) -> np.ndarray:
    """A boolean array of length `size` from an int bitset (bit k -> element k)."""
    raw = np.frombuffer(bits.to_bytes((size + 7) // 8 or 1, "little"), dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little")[:size].astype(bool)

"""From a function and example arguments to a RematPlan: trace, cut into blocks, solve each
distinct block's ILP once, then the sequence DP under the budget."""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from .block_ilp import BlockOption, pareto_front, pareto_options
from .calibrate import measured_forward, measured_option, saved_bytes
from .block_graph import block_graph
from .blocks import BLOCK_PREFIX, Block, Chain, find_chain
from .graph.op_graph import OpGraph
from .graph.signature import fingerprint
from .graph.trace import trace_graph
from .plan import BlockChoice, InfeasibleBudgetError, RematPlan
from .sequence_dp import ChainBlock, ChainOption, min_peak, schedule_cost, solve_chain

DP_UNITS = 400  # memory discretisation of the sequence DP
# XLA temp memory the model does not see per block (fusion scratch, gradient accumulators).
BASE_OVERHEAD_BYTES = 0
CALIBRATED_OPTIONS = 2  # up-front compiles per distinct block (plus its forward; chosen options measured on demand)


@dataclass(frozen=True)
class Traced:
    """A traced function: its op graph, its chain of blocks and their options."""

    program: OpGraph
    chain: Chain
    options: list[tuple[BlockOption, ...]]  # per block, Pareto options
    chain_blocks: list[ChainBlock]  # per block, options in bytes
    fingerprint: str
    calibrate: bool = True  # chosen options not yet measured are measured on demand


def trace(f: Callable, args: tuple, kwargs: Mapping | None = None) -> OpGraph:
    """The op graph of f(*args, **kwargs), custom derivative rules kept (the graph is
    differentiated after rescheduling) and calls made through `rockmate.block` marked."""
    return trace_graph(f, *args, keep_custom_rules=True, mark_calls=BLOCK_PREFIX, **dict(kwargs or {}))


def analyze(f: Callable, args: tuple, profile: Mapping[str, float] | None = None,
            ilp_time_limit_s: float = 5.0, calibrate: bool = True) -> Traced:
    """Trace `f`, cut it into blocks and solve the block ILP once per distinct block."""
    program = trace(f, args)
    chain = find_chain(program)
    cache: dict[str, tuple[tuple[BlockOption, ...], ChainBlock]] = {}
    opts, cblocks = [], []
    for blk in chain.blocks:
        if blk.signature not in cache:
            cache[blk.signature] = _block_options(program, blk, profile, ilp_time_limit_s, calibrate)
        o, c = cache[blk.signature]
        opts.append(o)
        cblocks.append(c)
    return Traced(program, chain, list(opts), list(cblocks), fingerprint(program), calibrate)


def _calibrated(g, program, start, stop):
    """Replace the analytic forward working-memory guess with XLA's measured one."""
    fwd = measured_forward(program, start, stop)
    return g if fwd is None else dataclasses.replace(g, fwd_ws_bytes=fwd)


def _measured_options(options, program, blk):
    """Correct each option's backward peak by XLA's measured temp memory of the block lowered
    with it: measured for up to CALIBRATED_OPTIONS options spread over kept bytes (all of
    them on most blocks; the analytic peak of the low-memory options, the ones tight budgets
    pick, can be off by 2x), interpolated piecewise-linearly by kept bytes for the others."""
    fixed = []
    for o in options:
        kept = None if o.keep_all else saved_bytes(program, blk.start, blk.stop, o.kept)
        if kept is not None:
            o = dataclasses.replace(o, kept_bytes=kept, fwd_peak_bytes=o.fwd_peak_bytes - o.kept_bytes + kept)
        fixed.append(o)
    by_kept = sorted(range(len(fixed)), key=lambda i: fixed[i].kept_bytes)
    n = len(by_kept)
    probes = {by_kept[round(j * (n - 1) / max(CALIBRATED_OPTIONS - 1, 1))]
              for j in range(min(n, CALIBRATED_OPTIONS))}
    delta = {}
    for i in sorted(probes):
        o = fixed[i]
        m = measured_option(program, blk, o)
        if m is not None:
            delta[i] = m - o.bwd_peak_bytes
    if not delta:
        return pareto_front(fixed)
    points = sorted((fixed[i].kept_bytes, d) for i, d in delta.items())
    out = []
    for i, o in enumerate(fixed):
        d = delta[i] if i in delta else _interpolate(points, o.kept_bytes)
        out.append(dataclasses.replace(o, bwd_peak_bytes=max(int(o.bwd_peak_bytes + d), o.kept_bytes),
                                       calibrated=i in delta))
    return pareto_front(out)


def _refine(t: Traced, tree) -> bool:
    """Measure the options `tree` uses whose backward peak is still interpolated (an
    interpolated peak was 20-30 % low on GPT blocks) and update every block of the same
    signature; True if anything changed, so the caller solves again."""
    if not t.calibrate:
        return False
    changed = False
    for i, j in sorted(_chosen_options(tree).items()):
        blk, o, co = t.chain.blocks[i], t.options[i][j], t.chain_blocks[i].options[j]
        if o.calibrated:
            continue
        m = measured_option(t.program, blk, o)
        peak = co.bwd_peak if m is None else max(int(m), co.kept)
        new_o = dataclasses.replace(o, bwd_peak_bytes=o.bwd_peak_bytes if blk.is_scan else peak, calibrated=True)
        for k, other in enumerate(t.chain.blocks):
            if other.signature == blk.signature:
                opts = list(t.options[k])
                opts[j] = new_o
                t.options[k] = tuple(opts)
                cb = t.chain_blocks[k]
                copts = list(cb.options)
                copts[j] = dataclasses.replace(copts[j], bwd_peak=peak)
                t.chain_blocks[k] = dataclasses.replace(cb, options=tuple(copts))
        changed = changed or peak != co.bwd_peak
    return changed


def _interpolate(points, x):
    """Piecewise-linear through sorted (x, y) points, constant beyond the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    return points[-1][1]


def _block_options(program, blk, profile, time_limit_s, calibrate=True):
    if not blk.is_scan:
        g = block_graph(program, blk.start, blk.stop, profile)
        if calibrate:
            g = _calibrated(g, program, blk.start, blk.stop)
        options = pareto_options(g, time_limit_s=time_limit_s)
        if calibrate:
            options = _measured_options(options, program, blk)
        cb = ChainBlock(tuple(ChainOption(o.fwd_time_s, o.bwd_time_s, o.kept_bytes, o.fwd_peak_bytes,
                                          o.bwd_peak_bytes) for o in options),
                        nr_time_s=sum(g.times_s), nr_peak=g.fwd_ws_bytes)
        return options, cb
    op = program.ops[blk.start]
    body = op.body
    g = block_graph(body, 0, len(body.ops), profile)
    if calibrate:
        g = _calibrated(g, body, 0, len(body.ops))
    options = pareto_options(g, time_limit_s=time_limit_s)
    if calibrate:  # the body alone; the scan whole is measured when the DP picks an option
        whole = Block(0, len(body.ops), False, "")
        options = tuple(dataclasses.replace(o, calibrated=False) for o in _measured_options(options, body, whole))
    length = op.params["length"]
    nc, ncarry = op.params["num_consts"], op.params["num_carry"]
    carry_bytes = sum(program.vars[a].nbytes for a in op.inputs[nc:nc + ncarry])
    # per iteration the checkpointed body saves its carry input and its kept values
    copts = []
    for o in options:
        kept = length * (o.kept_bytes + carry_bytes)
        copts.append(ChainOption(length * o.fwd_time_s, length * o.bwd_time_s, kept,
                                 kept + g.fwd_ws_bytes, kept + o.bwd_peak_bytes - o.kept_bytes))
    cb = ChainBlock(tuple(copts), nr_time_s=length * sum(g.times_s), nr_peak=g.fwd_ws_bytes)
    return options, cb


def _scaled(cblocks, cut_bytes, unit: float):
    """Chain in integer units: sizes rounded up (so a fitting schedule fits in bytes)."""
    up = lambda b: int(math.ceil(b / unit))  # noqa: E731
    blocks = tuple(ChainBlock(tuple(ChainOption(o.fwd_time_s, o.bwd_time_s, up(o.kept), up(o.fwd_peak),
                                                up(o.bwd_peak)) for o in cb.options),
                              cb.nr_time_s, up(cb.nr_peak)) for cb in cblocks)
    return blocks, [up(a) for a in cut_bytes[1:-1]]


def _slots(chain: Chain) -> list[int]:
    # slot 0 = program inputs (arguments, not temp); last slot = program outputs (not temp)
    return [0] + list(chain.cut_bytes[1:-1]) + [0]


def fixed_bytes(chain: Chain) -> int:
    """Temp memory outside the DP's control: values shared by several blocks."""
    return chain.side_bytes + BASE_OVERHEAD_BYTES


def min_budget_of(t: Traced) -> int:
    """Smallest temp memory any schedule reaches (bytes, in the model; the options it uses
    measured)."""
    while True:
        peak, tree = min_peak(t.chain_blocks, _slots(t.chain))
        if not _refine(t, tree):
            return fixed_bytes(t.chain) + peak


def make_plan(t: Traced, budget_bytes: int, units: int = DP_UNITS) -> RematPlan:
    """Solve the sequence DP for `budget_bytes` and package the result."""
    t0 = time.perf_counter()
    while True:
        lowest = min_budget_of(t)
        avail = budget_bytes - fixed_bytes(t.chain)
        if budget_bytes < lowest:
            raise InfeasibleBudgetError(budget_bytes, lowest)
        slots = _slots(t.chain)
        unit = max(avail / units, 1.0)
        sblocks, inner = _scaled(t.chain_blocks, slots, unit)
        res = solve_chain(sblocks, [0] + inner + [0], int(avail // unit))
        if res is None:
            # rounding sizes up to units can lose a feasible budget near the minimum:
            # fall back to the exact least-memory schedule
            tree = min_peak(t.chain_blocks, slots)[1]
        else:
            tree = res[1]
        if not _refine(t, tree):
            break
    time_s, peak = schedule_cost(t.chain_blocks, slots, tree, 0, len(t.chain_blocks) - 1)
    chosen = _chosen_options(tree)
    choices = []
    for i, blk in enumerate(t.chain.blocks):
        o = t.options[i][chosen[i]]
        choices.append(BlockChoice(blk.start, blk.stop, blk.is_scan, o.kept, o.keep_all,
                                   t.chain_blocks[i].options[chosen[i]].kept,
                                   t.chain_blocks[i].options[chosen[i]].fwd_time_s,
                                   t.chain_blocks[i].options[chosen[i]].bwd_time_s))
    return RematPlan(budget_bytes=budget_bytes, min_budget_bytes=lowest,
                     predicted_temp_bytes=int(fixed_bytes(t.chain) + peak), predicted_time_s=time_s,
                     blocks=tuple(choices), schedule=tree, fingerprint=t.fingerprint,
                     solve_time_s=time.perf_counter() - t0)


def _chosen_options(tree) -> dict[int, int]:
    from .sequence_dp import Leaf
    out: dict[int, int] = {}
    stack = [tree]
    while stack:
        x = stack.pop()
        if x is None:
            continue
        if isinstance(x, Leaf):
            out[x.block] = x.option
            stack.append(x.rest)
        else:
            stack.extend([x.left, x.right])
    return out

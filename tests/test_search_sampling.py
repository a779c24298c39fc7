"""How the search draws and moves through schedules: degenerate tile levels and register-filling
micro-kernel tiles in annotation, tile-size mutations that can empty a level in one move,
batches that take one schedule per tiling instead of the model's favourite tiling with every
unroll depth, and a share of each batch screened by the model from new random schedules."""
import json
import random
import zlib
from math import prod

from search import Task
from search.evolution import SCREEN_SHARE, TILING_REPEATS, EvolutionarySearch
from search.mutation import checked_program, mutate_tile_size, tiling
from search.schedule import split_lengths
from search.sketch import (DEGENERATE_PROB, REGISTER_TILE_PROB, REGISTER_TILE_VECTORS, generate_sketches,
                           register_tile_options, sample_factors, sample_schedules)

from policy_stubs import TrainedLookingModel


def test_sampled_factors_keep_the_split_rules_with_degenerate_levels():
    rng = random.Random(0)
    for extent, pad in ((4096, False), (1024, True), (96, True), (7, False)):
        for _ in range(300):
            f = sample_factors(extent, 3, rng, max_inner=64, lanes=16, pad=pad)
            lengths = split_lengths(extent, f)          # raises if the factors break the rules
            assert f[-1] <= 64 and prod(lengths) >= extent


def test_outer_tile_levels_are_often_degenerate():
    """A BLIS-like column panel (j of 4096 as 64 panels x 1 x 1 x 64) is drawn about 1 in 10 times
    given the 64-wide innermost tile (DEGENERATE_PROB 0.5 on each middle level), against 1 in 49
    for a uniform divisor at each level."""
    rng = random.Random(1)
    draws = [sample_factors(4096, 3, rng, max_inner=64, lanes=16) for _ in range(4000)]
    inner64 = [f for f in draws if f[-1] == 64]
    panels = sum(f[:2] == [1, 1] for f in inner64) / len(inner64)
    uniform = 1 / 49
    assert panels > 3 * uniform
    want = (DEGENERATE_PROB / 2 + (1 - DEGENERATE_PROB) / 7) ** 2   # j.2 = 1 and then j.1 = 1
    assert abs(panels - want) < 0.05


def test_a_tile_mutation_can_empty_a_level_in_one_move():
    """Ansor's tile-size mutation moves any factor of a level, not only a prime one: from
    j = 4 x 4 x 4 x 64 one move reaches a schedule with a level of length 1."""
    task = Task.matmul(64, 4096, 64)
    dag = task.dag
    base = None
    for s in sample_schedules(generate_sketches(dag), dag, 400, random.Random(2)):
        cand = [dict(x, factors=[4, 4, 64]) if x["kind"] == "split" and x["stage"] == "C" and x["iter"] == "j"
                and len(x["factors"]) == 3 else x for x in s]
        if cand != s and checked_program(dag, cand) is not None:
            base = cand
            break
    assert base is not None
    rng = random.Random(3)
    emptied = 0
    for _ in range(200):
        child = mutate_tile_size(dag, base, rng)
        if child is None:
            continue
        for x in child:
            if x["kind"] == "split" and x["stage"] == "C" and x["iter"] == "j" and x["factors"] != [4, 4, 64]:
                emptied += 1 in split_lengths(4096, x["factors"])
    assert emptied > 0


def test_model_picks_take_one_schedule_per_tiling(monkeypatch):
    """A model that scores one tiling highest (in every unroll and parallel variant) gets one of
    its variants per batch, and none once that tiling has been measured TILING_REPEATS times."""
    task = Task.matmul(64, 64, 64)
    pol = EvolutionarySearch(task, seed=0)
    pol.model = TrainedLookingModel()
    fav = sample_schedules(pol.sketches, task.dag, 1, random.Random(4))[0]
    monkeypatch.setattr(pol, "scores", lambda pop: [10.0 if tiling(s) == tiling(fav) else 0.0 for s in pop])
    pol.best = [(1e-3, fav)]  # the favourite is an elite, so evolution keeps producing its variants
    batch = pol.next_batch(16)
    n_model = 16 - max(1, round(16 * pol.eps_greedy))   # evolved and screened picks
    model_part = [tiling(s) for s in batch[:n_model]]
    assert model_part.count(tiling(fav)) <= 1
    assert len(set(model_part)) == len(model_part)
    pol.tiling_count[tiling(fav)] = TILING_REPEATS
    assert tiling(fav) not in [tiling(s) for s in pol.next_batch(16)[:n_model]]


def test_elites_hold_one_schedule_per_tiling():
    task = Task.matmul(64, 64, 64)
    pol = EvolutionarySearch(task, seed=0)
    s = sample_schedules(pol.sketches, task.dag, 30, random.Random(5))
    variant = [dict(x, auto_unroll_max_step=64 - x["auto_unroll_max_step"]) if x["kind"] == "pragma" else x
               for x in s[0]]
    assert tiling(variant) == tiling(s[0]) and variant != s[0]
    pol.best = sorted([(1e-3, s[0]), (1.1e-3, variant)] + [(2e-3 + i * 1e-5, x) for i, x in enumerate(s[1:])],
                      key=lambda x: x[0])
    el = pol.elites()
    assert s[0] in el and variant not in el
    assert len({tiling(x) for x in el}) == len(el)


def test_register_tile_options_fill_the_vector_registers():
    """Row x column micro-kernels for a 1024 x 4096 dense: columns whole vectors dividing 4096,
    rows dividing 1024 or padded (6 of 1024), accumulators within REGISTER_TILE_VECTORS."""
    from search.schedule import initial_state
    task = Task.dense(1024, 4096, 1024, "gelu")
    st = initial_state(task.dag).stage("C")
    opts = register_tile_options(st)
    lo, hi = REGISTER_TILE_VECTORS
    assert (6, 64) in opts and (8, 32) in opts and (4, 64) in opts
    assert (8, 64) not in opts and (2, 16) not in opts          # 32 and 2 vectors
    for r, c in opts:
        assert c % 16 == 0 and 4096 % c == 0 and lo <= r * c // 16 <= hi
        split_lengths(1024, [r])                                # a divisor or an allowed padded tile
    softmax = Task.softmax(64, 64)
    assert all(register_tile_options(s) == [] for s in initial_state(softmax.dag).stages)


def test_annotation_gives_register_filling_tiles_about_as_often_as_asked():
    task = Task.matmul(512, 512, 512)
    dag = task.dag
    lo, hi = REGISTER_TILE_VECTORS
    scheds = sample_schedules(generate_sketches(dag), dag, 400, random.Random(6))
    filled = 0
    for s in scheds:
        f = {x["iter"]: x["factors"] for x in s if x["kind"] == "split" and x["stage"] in ("C", "C.local")
             and len(x["factors"]) == 3}
        r, c = f["i"][-1], f["j"][-1]
        filled += c % 16 == 0 and lo <= r * c // 16 <= hi
    # REGISTER_TILE_PROB of the schedules by construction, plus independent draws that land there
    assert REGISTER_TILE_PROB <= filled / len(scheds) < REGISTER_TILE_PROB + 0.25


def test_screened_slots_are_the_models_best_of_new_random_schedules(monkeypatch):
    """A quarter of a batch is the model's best of SCREEN_POOL new random schedules: with a
    model whose scores are a fixed pseudo-random function of the schedule, every screened pick
    scores above the 90th percentile of an independent pool of new schedules."""
    task = Task.matmul(64, 64, 64)
    pol = EvolutionarySearch(task, seed=0)
    pol.model = TrainedLookingModel()
    score = lambda s: zlib.crc32(json.dumps(s, sort_keys=True).encode()) / 2 ** 32  # noqa: E731
    monkeypatch.setattr(pol, "scores", lambda pop: [score(s) for s in pop])
    monkeypatch.setattr(pol, "evolve", lambda: [(0.0, s) for s in sample_schedules(
        pol.sketches, task.dag, 64, random.Random(7))])   # exploitation picks: whatever they are
    batch = pol.next_batch(16)
    n_random = max(1, round(16 * pol.eps_greedy))
    n_screen = round(16 * SCREEN_SHARE)
    screened = batch[16 - n_random - n_screen:16 - n_random]
    assert len(screened) == n_screen == 4
    ref = sorted(score(s) for s in sample_schedules(pol.sketches, task.dag, 256, random.Random(8)))
    assert min(score(s) for s in screened) > ref[int(0.9 * len(ref))]

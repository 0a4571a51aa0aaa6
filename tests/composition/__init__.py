"""The composition matrix: every pair of feature levels that can go together, in a few configurations.

    python -m tests.composition --pairs      # "pairs covered: X of Y", then the configurations

Each factor is a feature of the engine and its levels; ``outcome(config)`` says whether a configuration runs, is
refused (a documented refusal, asserted with its message), or means nothing (a tie across ranks under a V schedule,
which puts the first and the last stage on one rank). The pairs that can go together are found from every
combination of the factors that decide whether a configuration runs (DECIDING; the others decide nothing); a
greedy covering array (AETG's rule: each new configuration covers as many uncovered pairs as it can, from random
completions of an uncovered pair, seed fixed) picks configurations until every pair is covered by one that runs,
or, where every configuration holding it is refused, by one asserted refused.
tests/pipeengine/test_composition.py runs them against one process (tests/composition/harness.py).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["FACTORS", "Config", "Matrix", "matrix", "outcome"]

V_SCHEDULES = ("zb-v", "v-half", "v-min", "dualpipe-v")  # two stages per rank, the first and the last on rank 0
FACTORS: dict[str, tuple[object, ...]] = {
    "schedule": ("gpipe", "1f1b", "interleaved", "zb-h1", *V_SCHEDULES),
    "data": ("dp1", "dp2", "fsdp", "fsdp-reshard"),  # replicas: none, 2 all-reducing, 2 sharded (FSDP2)
    "tp": (1, 2),
    "tie": ("none", "across", "v-rank"),  # the first layer's weight is the last's: on two ranks, or on one of a V
    "loss": ("mean", "sum"),  # the mean over micro-batches, or a sum over units with loss_count
    "accumulate": (1, 2),  # train_steps before the optimizer's step, no zero_grad between
    "precision": ("fp32", "bf16", "fp16"),
    "checkpoint": ("never", "always"),
    "after": ("clip", "eval", "trace", "reload", "hf-export"),  # what the step is followed by (trace: the step)
    "model": ("mlp", "gpt", "llama"),  # an MLP with a batch norm, a small GPT, a Hugging Face Llama
    "compile": ("off", "on"),  # the blocks torch.compile'd (aot_eager: inductor's own run is test_compile's)
}
COMPILE = {"mlp": 1.0, "gpt": 3.0, "llama": 8.0}  # seconds a rank spends compiling each model's blocks, about
SEED = 3  # of seeds 0-5, one whose matrix costs least: 46 configurations, 3 of them on 8 ranks (measured)
PRICE = 0.2  # pairs a configuration must cover for each second it costs (tests/composition: cost)
REFUSALS = {  # (factor, level) pairs the docs (guides) document as refused -> what the refusal says
    frozenset({("data", "fsdp"), ("tie", "v-rank")}): r"FSDP2 shards each stage on its own",
    frozenset({("data", "fsdp-reshard"), ("tie", "v-rank")}): r"FSDP2 shards each stage on its own",
}


@dataclass(frozen=True)
class Config:
    schedule: str
    data: str
    tp: int
    tie: str
    loss: str
    accumulate: int
    precision: str
    checkpoint: str
    after: str
    model: str
    compile: str

    @property
    def data_parallel(self) -> int:
        return 1 if self.data == "dp1" else 2

    @property
    def world(self) -> int:
        return self.data_parallel * 2 * self.tp  # two pipeline positions

    @property
    def processes(self) -> bool:
        """Whether it needs torch.distributed or a process of its own (gloo processes), else in-process ranks serve:
        DTensor's collectives, compiling (one compiler per process)."""
        return self.tp > 1 or self.data.startswith("fsdp") or self.compile == "on"

    def levels(self) -> Iterator[tuple[str, object]]:
        return ((name, getattr(self, name)) for name in FACTORS)

    def __str__(self) -> str:
        return " ".join(f"{name}={value}" for name, value in self.levels())


def outcome(config: Config) -> str:
    """ "runs", "refused" (a documented refusal: REFUSALS) or "impossible"."""
    return _outcome(dict(config.levels()))


def _outcome(levels: dict[str, object]) -> str:
    """The same for some factors only: what the ones given already decide ("runs" if nothing yet)."""
    schedule, tie = levels.get("schedule"), levels.get("tie")
    if schedule is not None and tie is not None:
        v = schedule in V_SCHEDULES
        if (tie == "across" and v) or (tie == "v-rank" and not v):
            return "impossible"  # a V puts the first and the last stage on rank 0: a tie of them is on one rank
    if levels.get("after") == "hf-export" and levels.get("model", "llama") != "llama":
        return "impossible"  # hf.save_pretrained writes a Hugging Face model
    refused = any(all(levels.get(name, _ABSENT) == level for name, level in pair) for pair in REFUSALS)
    return "refused" if refused else "runs"


_ABSENT = object()
# the factors _outcome reads: whether a configuration runs follows from its levels of these alone
DECIDING = tuple(dict.fromkeys(["schedule", "tie", "after", "model", *(name for pair in REFUSALS for name, _ in pair)]))
_ORDER = {name: index for index, name in enumerate(FACTORS)}


def _pair(a: tuple[str, object], b: tuple[str, object]) -> tuple[tuple[str, object], tuple[str, object]]:
    """Two levels of two factors in the factors' order (as _pairs lists a configuration's)."""
    return (a, b) if _ORDER[a[0]] < _ORDER[b[0]] else (b, a)


@dataclass(frozen=True)
class Matrix:
    running: tuple[Config, ...]  # each runs against one process
    refused: tuple[tuple[Config, str], ...]  # each is asserted refused with the message
    possible: int  # pairs of levels some configuration holds (that runs, or is refused)
    covered: int


def cost(config: Config | dict[str, object]) -> float:
    """What a configuration costs to run, roughly (seconds of CPU): each rank builds and trains, more if it is a
    process, much more if it compiles (dynamo traces a Hugging Face attention for seconds), more for the bigger
    models and tensor parallelism. Of some factors only (a dict): what those already cost, the others at their
    cheapest."""
    levels = dict(config.levels()) if isinstance(config, Config) else config
    data, tp = levels.get("data", "dp1"), levels.get("tp", 1)
    world = (1 if data == "dp1" else 2) * 2 * tp  # type: ignore[operator]
    processes = tp > 1 or str(data).startswith("fsdp") or levels.get("compile") == "on"  # type: ignore[operator]
    model = levels.get("model", "mlp")
    compiling = COMPILE[model] * (levels.get("compile") == "on") * (3 if tp > 1 else 1)  # type: ignore[index, operator]  # DTensors
    tracing = (0.5 + 0.5 * (model == "llama")) * (levels.get("after") == "trace" and processes)  # the user's profiler
    each = (1.0 if processes else 0.3) + compiling + tracing + 0.5 * (model == "llama")
    return world * (each + 0.3 * (tp > 1)) + 0.5 * (levels.get("after") in ("reload", "hf-export"))  # type: ignore[operator]


def _complete(chosen: dict[str, object], uncovered: set[object], rng: random.Random, price: float) -> Config | None:
    """AETG's completion: the other factors in a random order, each the level covering the most uncovered pairs
    with those chosen so far (the cheaper on a tie); a completion that does not run is dropped."""
    order = [name for name in FACTORS if name not in chosen]
    rng.shuffle(order)
    for name in order:
        chosen[name] = max(FACTORS[name], key=lambda level, n=name: _gain(chosen, n, level, uncovered, price, rng))  # type: ignore[misc]
    config = Config(**chosen)  # type: ignore[arg-type]
    return config if outcome(config) == "runs" else None


def _gain(
    chosen: dict[str, object], name: str, level: object, uncovered: set[object], price: float, rng: random.Random
) -> tuple[bool, float, float]:
    """A level's worth to a partial configuration: whether it still runs, then the uncovered pairs it adds less its
    price (tests/composition: cost), then chance."""
    new = {_pair((name, level), item) for item in chosen.items()}
    runs = _outcome({**chosen, name: level}) == "runs"
    return runs, len(new & uncovered) - price * cost({**chosen, name: level}), rng.random()


def _pairs(config: Config) -> set[tuple[tuple[str, object], tuple[str, object]]]:
    return set(itertools.combinations(config.levels(), 2))


def _possible() -> tuple[set[object], set[object]]:
    """The pairs some running configuration holds, and those some refused one holds: from every combination of the
    deciding factors' levels (DECIDING), each completed by any level of the others, which decide nothing."""
    free = [(name, level) for name in FACTORS if name not in DECIDING for level in FACTORS[name]]
    runnable: set[object] = set()
    refusable: set[object] = set()
    for values in itertools.product(*(FACTORS[name] for name in DECIDING)):
        kind = _outcome(dict(zip(DECIDING, values, strict=True)))
        if kind == "impossible":
            continue
        held = list(zip(DECIDING, values, strict=True))
        found = runnable if kind == "runs" else refusable
        found.update(_pair(a, b) for a, b in itertools.combinations(held, 2))
        found.update(_pair(a, b) for a in held for b in free)
    # two free levels go together wherever any combination runs (or is refused): once, not once per combination
    free_pairs = {_pair(a, b) for a, b in itertools.combinations(free, 2) if a[0] != b[0]}
    for found in (runnable, refusable):
        if found:
            found |= free_pairs
    return runnable, refusable


@functools.cache
def matrix(seed: int = SEED, candidates: int = 40, price: float = PRICE) -> Matrix:
    """The configurations covering every pair that can go together (see the module docstring)."""
    runnable, refusable = _possible()
    only_refused = refusable - runnable
    rng = random.Random(seed)
    uncovered, running = set(runnable), []
    while uncovered:
        pair = min(uncovered, key=str)  # the first uncovered pair, in a fixed order
        best = max(
            (_complete(dict(pair), uncovered, rng, price) for _ in range(candidates)),
            key=lambda c: len(_pairs(c) & uncovered) - price * cost(c) if c else -1e9,
        )
        if best is None:
            raise RuntimeError(f"no running configuration holds {pair}")
        running.append(best)
        uncovered -= _pairs(best)
    refused = []
    for pair in sorted(only_refused, key=str):  # each asserted refused once, in a running configuration's place
        message = REFUSALS[frozenset(pair)]
        values = dataclasses.asdict(running[0]) | dict(pair) | {"schedule": "zb-v"}  # a V: a tie on one rank
        config = Config(**values)
        if outcome(config) != "refused":
            raise RuntimeError(f"{config} should be refused for {pair}")
        refused.append((config, message))
    covered = len(runnable - uncovered) + len({pair for config, _ in refused for pair in _pairs(config)} & only_refused)
    return Matrix(tuple(running), tuple(refused), len(runnable) + len(only_refused), covered)

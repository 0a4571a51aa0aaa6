"""tune's candidates: every (dp, pp, tp) layout the engine can build for a model, and every candidate of each
(schedule, chunks, micro-batch count, partition method, checkpoint option) with what it is priced from; what cannot
be built is refused with the reason, by the engine's own rules (the schedule compiler, pipeengine.parallel's ties).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from torch import nn

from pipeengine.construction.layercosts import LayerCosts
from pipeengine.construction.partition import cut_points, method_costs, solve
from pipeengine.parallel import checked_ties
from pipeengine.planner.costmodel import LayerProfile
from pipeengine.planner.pricing import Spec
from pipeengine.planner.result import Candidate
from schedules import Schedule, build_schedule, registration, with_gradient_sync

__all__ = ["Layout", "candidate_specs", "layouts", "named"]

Layout = tuple[int, int, int]  # (dp, pp, tp)


def candidate_specs(
    model: nn.Sequential,
    found: list[Layout],
    fsdp: bool | None,
    names: list[str],
    counts: dict[int, list[int]],
    per_replica: dict[int, int],
    profiles: dict[tuple[int, int, bool], LayerProfile],
    methods: Sequence[str],
    checkpoint: Sequence[str],
    transport: object,
    refused: dict[str, str],
    tp_plan: object,
) -> list[tuple[Spec, Candidate]]:
    """Each candidate of every layout to price, and what it is (the programs, cuts and engine checks shared among
    the layouts that can share them)."""
    specs: list[tuple[Spec, Candidate]] = []
    programs: dict[tuple[str, int, int, int, bool], Schedule | str] = {}  # shared by the layouts of one pipeline size
    cuts: dict[tuple[int, int, bool, str, int], list[tuple[int, int]]] = {}  # (rows, tp, alone, method, stages)
    checked: dict[tuple[object, ...], str] = {}  # (bounds, placement, fsdp) -> why the engine refuses it ("": builds)
    for layout in found:
        dp, pp, tp = layout
        for sharded in ([fsdp] if fsdp is not None else [False, True]) if dp > 1 else [False]:
            specs += _layout_candidates(
                model,
                layout,
                sharded,
                names,
                counts[dp],
                per_replica[dp],
                profiles,
                methods,
                checkpoint,
                transport,
                refused,
                programs,
                cuts,
                checked,
                tp_plan,
            )
    return specs


def layouts(
    model: nn.Sequential,
    world_size: int,
    batch: int,
    data_parallel: int | None = None,
    tensor_parallel: int | None = None,
    tp_plan: object = None,
    fsdp: bool | None = None,
    backend: str = "gloo",
    refused: dict[str, str] | None = None,
) -> list[Layout]:
    """Every (dp, pp, tp) with dp x pp x tp = world_size the engine can build for this model; each other
    factorisation is in ``refused`` with the reason."""
    refused = refused if refused is not None else {}
    found = []
    for dp in [d for d in range(1, world_size + 1) if world_size % d == 0]:
        for tp in [t for t in range(1, world_size // dp + 1) if (world_size // dp) % t == 0]:
            layout = (dp, world_size // (dp * tp), tp)
            why = _illegal(model, layout, batch, data_parallel, tensor_parallel, tp_plan, fsdp, backend)
            if why is None:
                found.append(layout)
            elif why:  # "" : not asked for
                refused[named(layout)] = why
    return found


def _illegal(
    model: nn.Sequential,
    layout: Layout,
    batch: int,
    data_parallel: int | None,
    tensor_parallel: int | None,
    tp_plan: object,
    fsdp: bool | None,
    backend: str,
) -> str | None:
    dp, pp, tp = layout
    if (data_parallel is not None and dp != data_parallel) or (tensor_parallel is not None and tp != tensor_parallel):
        return ""
    if tp > 1 and tp_plan is None:
        return ""  # not asked for: tensor parallelism only with a plan
    if tp > 1 and backend == "loopback":
        return "tensor parallelism runs DTensor collectives, which in-process ranks cannot host"
    if fsdp and dp == 1:
        return "fsdp=True needs data_parallel > 1 replicas to shard over"
    if fsdp and backend == "loopback":
        return "FSDP runs DTensor collectives, which in-process ranks cannot host"
    if pp > len(model):
        return (
            f"{pp} pipeline stages need at least {pp} layers, one per stage; the model has {len(model)}: use at "
            f"most {len(model)} pipeline ranks (more replicas), or split the model into more nn.Sequential layers"
        )
    if data_parallel is None and batch % dp:
        return f"the batch of {batch} rows does not split equally into {dp} replicas"
    return None


def _layout_candidates(
    model: nn.Sequential,
    layout: Layout,
    sharded: bool,
    names: Sequence[str],
    counts: Sequence[int],
    rows: int,
    profiles: Mapping[tuple[int, int, bool], LayerProfile],
    methods: Sequence[str],
    checkpoint: Sequence[str],
    transport: object,
    refused: dict[str, str],
    programs: dict[tuple[str, int, int, int, bool], Schedule | str],
    cuts: dict[tuple[int, int, bool, str, int], list[tuple[int, int]]],
    checked: dict[tuple[object, ...], str],
    tp_plan: object,
) -> list[tuple[Spec, Candidate]]:
    """Every candidate of one layout (schedule, chunks, micro-batches, partition and checkpointing), to be priced:
    what it is priced from, and the candidate (unpriced). ``programs``: each program as the transport runs it (with
    the replicas' ARs), or why it cannot be built; ``cuts``: each partition by (rows, tp, one pipeline rank, method,
    stages); ``checked``: why the engine refuses each cut on its placement (_refusal); all kept across layouts and
    FSDP on and off. A cut the engine would refuse is no candidate."""
    dp, ranks, tp = layout
    layers = len(model)
    seen: dict[tuple[object, ...], int] = {}
    found: list[tuple[Spec, Candidate]] = []
    why: dict[str, str] = {}  # schedule -> why it gave this layout nothing
    for name in names:
        record = registration(name)
        for chunks in record.chunks or tuple(v for v in (2, 3, 4) if ranks * v <= layers):
            stages = ranks * chunks
            if stages > layers:
                continue
            for m in counts:
                program = programs.get((name, ranks, m, chunks, dp > 1))
                if program is None:
                    program = programs[name, ranks, m, chunks, dp > 1] = _program(
                        transport, name, ranks, m, chunks, dp > 1
                    )
                if isinstance(program, str):  # m does not suit this schedule (interleaved: a multiple of p)
                    why[name] = program
                    continue
                profile = profiles.get((rows // m, tp, True)) if ranks == 1 else None  # warm, on the CPU
                profile = profile or profiles.get((rows // m, tp, False))
                if profile is None:
                    continue
                joined = profile.shards_output[:-1]  # no stage ends on a tensor-parallel shard
                most = len(cut_points(layers, joined))
                if stages > most:
                    why[name] = (
                        f"{stages} stages, but with tp={tp} the tp_plan lets the model be cut into {most} at "
                        "most (a stage cannot end on a layer whose output is a shard)"
                    )
                    continue
                for method in methods:
                    bounds = cuts.get((rows // m, tp, ranks == 1, method, stages))
                    if bounds is None:
                        bounds = cuts[rows // m, tp, ranks == 1, method, stages] = solve(
                            method_costs(method, LayerCosts.of(profile, model)), stages, joined
                        )
                    refusal = _refusal(model, bounds, program.placement, sharded, checked)
                    if refusal:  # the engine would refuse to build it
                        why[name] = refusal
                        continue
                    partition = tuple(b - a for a, b in bounds)
                    for option in checkpoint:
                        if option == "except_last" and stages == 1:
                            continue  # the same as never
                        key = (name, m, chunks, partition, option)
                        if key in seen:  # another method cut it the same way
                            spec, old = found[seen[key]]
                            found[seen[key]] = (spec, dataclasses.replace(old, methods=(*old.methods, method)))
                            continue
                        seen[key] = len(found)
                        found.append(
                            (
                                Spec(program, profile, bounds, dp, sharded, option),
                                Candidate(
                                    name,
                                    m,
                                    chunks,
                                    (method,),
                                    partition,
                                    0.0,
                                    0.0,
                                    (),
                                    dp,
                                    sharded,
                                    tp,
                                    option,
                                    tp_plan if tp > 1 else None,  # type: ignore[arg-type]
                                ),
                            )
                        )
    if not found:
        refused[named(layout, sharded)] = (
            f"this layout builds with no schedule of {list(names)} (m in {list(counts)}, {ranks} pipeline "
            f"rank{'s' if ranks != 1 else ''}, {layers} layers)"
            + "".join(f"; {name}: {reason}" for name, reason in why.items())
        )
    return found


def _refusal(
    model: nn.Sequential,
    bounds: Sequence[tuple[int, int]],
    placement: Sequence[int],
    sharded: bool,
    checked: dict[tuple[object, ...], str],
) -> str:
    """Why the engine would refuse to build this cut on this placement ("": it builds), by the engine's own rule
    (pipeengine.parallel.checked_ties), asked once per cut: ``checked`` keeps each answer."""
    key = (tuple(bounds), tuple(placement), sharded)
    if key not in checked:
        try:
            checked_ties(model, bounds, placement, sharded)
            checked[key] = ""
        except ValueError as error:
            checked[key] = str(error)
    return checked[key]


def _program(transport: object, name: str, ranks: int, m: int, chunks: int, synced: bool) -> Schedule | str:
    """The schedule as the transport runs it, with each stage's AR where there are replicas; or why it cannot be
    built."""
    try:
        schedule = build_schedule(name, ranks, m, chunks)
    except ValueError as error:
        return str(error)
    program = transport.program(schedule)  # type: ignore[attr-defined]
    return with_gradient_sync(program) if synced else program


def named(layout: Layout, fsdp: bool = False) -> str:
    dp, pp, tp = layout
    return f"dp{dp} x pp{pp} x tp{tp}" + (" fsdp" if fsdp else "")

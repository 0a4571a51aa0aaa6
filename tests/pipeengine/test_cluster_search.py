"""The cluster planner end to end on a tiny Hugging Face config (issue 59, first step): the search's rows fit the
device and are ranked by the replayed step; a layout fixed by the user is priced exactly as the search priced it;
the command line's table, JSON rows and refusals. No processes, nothing allocated (the meta device)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from pipeengine.planner.cli import main
from pipeengine.planner.cluster import load
from pipeengine.planner.cluster.layout import estimate, price
from pipeengine.planner.cluster.models import from_config
from pipeengine.planner.cluster.search import candidates, search

transformers = pytest.importorskip("transformers")

CONFIG = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
}


def tiny() -> object:
    return transformers.LlamaConfig(**CONFIG)


def command(tmp_path: Path) -> list[str]:
    """The command line's arguments for the tiny model (its config written into ``tmp_path``) on 16 devices, its
    plot drawn there."""
    config = tmp_path / "config.json"
    config.write_text(tiny().to_json_string())
    plot = str(tmp_path / "plan.png")
    return ["--model", str(config), "--devices", "16", "--global-batch", "32", "--seq", "32", "--plot", plot]


def test_the_search_ranks_what_fits_by_the_replayed_step_and_a_fixed_layout_costs_the_same() -> None:
    hw = load("a100-80gb")
    model = from_config(tiny(), 32)
    plan = search(model, 16, hw, 32)
    assert plan.rows and [row.step_s for row in plan.rows] == sorted(row.step_s for row in plan.rows)
    assert all(not row.refused and row.peak_bytes <= hw.memory_bytes for row in plan.rows)
    layouts = {(row.layout.tp, row.layout.pp, row.layout.dp) for row in plan.rows}
    assert all(tp in (1, 2, 4) and pp in (1, 2, 4) and tp * pp * dp == 16 for tp, pp, dp in layouts)  # tp | heads
    for row in plan.rows:  # one pricing path: the user's fixed layout is the search's row
        assert price(model, row.layout, hw) == row


def test_the_command_line_prints_the_rows_writes_them_and_prices_a_fixed_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = command(tmp_path)
    assert main([*common, "--json", str(tmp_path / "rows.json")]) == 0
    printed = capsys.readouterr().out
    assert "16 devices (8 a node), 4 layers" in printed and "MFU" in printed and (tmp_path / "plan.png").exists()
    rows = json.loads((tmp_path / "rows.json").read_text())
    fields = {
        "tp",
        "pp",
        "dp",
        "fsdp",
        "schedule",
        "chunks",
        "micro_batch",
        "num_microbatches",
        "recompute",
        "step_time_s",
        "tokens_per_s",
        "mfu",
        "peak_bytes",
    }
    assert rows and all(fields <= set(row) for row in rows)
    best = rows[0]
    fix = (
        f"tp={best['tp']},pp={best['pp']},dp={best['dp']},micro_batch={best['micro_batch']},"
        f"schedule={best['schedule']},chunks={best['chunks']},recompute={best['recompute']},"
        f"fsdp={'always' if best['fsdp'] else 'never'}"
    )
    assert main([*common, "--fix", fix, "--json", str(tmp_path / "fixed.json")]) == 0
    assert json.loads((tmp_path / "fixed.json").read_text())[0]["step_time_s"] == best["step_time_s"]


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--fix", "tp=2,pp=2,dp=2,micro_batch=1"], r"--fix lays out tp x pp x dp = 8 devices, --devices is 16"),
        (["--fix", "tp=2,pp=2"], r"missing \['dp', 'micro_batch'\]"),
        (["--hardware", "b300"], r"b300"),
        (["--fix", "tp=2,pp=2,dp=4,micro_batch=1,fsdp=yes"], r"fsdp='yes', not always or never"),
        (["--fix", "tp=2,pp=2,dp=4,micro_batch=0"], r"--fix micro_batch='0': give a whole number, 1 or more"),
        (["--fix", "tp=2,pp=2,dp=4,micro_batch=x"], r"--fix micro_batch='x': give a whole number"),
        (["--fix", "tp=1,pp=16,dp=1,micro_batch=1"], r"pp=16 x chunks=1 does not divide the 4 layers"),
        (["--fix", "tp=16,pp=1,dp=1,micro_batch=1"], r"tp=16: tensor parallelism stays inside a node of 8 devices"),
        (["--fix", "tp=2,pp=2,dp=4,micro_batch=1,schedule=gpipe"], r"schedule 'gpipe' is not priced on clusters"),
        (["--fix", "tp=2,pp=2,dp=4,micro_batch=1,schedule=zb-v"], r"zb-v runs 2 chunk\(s\) a rank, got chunks=1"),
        (["--seq", "0"], r"--seq 0: give a whole number, 1 or more"),
        (["--devices", "12"], r"--devices 12 is not whole nodes of 8 devices"),
        (["--model", "nomodule_here:f"], r"--model nomodule_here:f: ModuleNotFoundError"),
    ],
)
def test_the_command_line_refuses_what_cannot_be_planned_saying_why(
    tmp_path: Path, extra: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([*command(tmp_path), *extra])
    assert code == 2
    assert re.search(said, capsys.readouterr().err)


def test_the_search_shards_the_replicas_where_copies_would_not_fit() -> None:
    """On 32 devices every layout has replicas (tp x pp is at most 16 here): a device too small for any layout's
    copies of the state but not for some layout's shards of it keeps only FSDP rows; fsdp='never' finds none that
    fits and says so; 'always' considers only sharded layouts."""
    model = from_config(tiny(), 32)
    hw = load("a100-80gb")

    def least(fsdp: str) -> float:
        return min(estimate(model, layout, hw).peak_bytes for layout in candidates(model, 32, hw, 32, fsdp=fsdp))

    assert least("always") < least("never")
    small = dataclasses.replace(hw, memory_bytes=(least("always") + least("never")) / 2)
    plan = search(model, 32, small, 32)
    assert plan.rows and all(row.layout.fsdp for row in plan.rows)
    with pytest.raises(
        ValueError, match="no layout of the .* considered fits; the one needing the least memory, .*, needs"
    ):
        search(model, 32, small, 32, fsdp="never").best  # noqa: B018
    assert search(model, 32, hw, 32, fsdp="always").considered * 2 == search(model, 32, hw, 32).considered


def test_every_schedule_is_searched_where_the_layers_allow_it() -> None:
    """1F1B, interleaved (v dividing a rank's layers, pp dividing m), ZB-H1, and ZB-V where a rank's layers split
    into its two chunks: 4 layers on 4 ranks have no ZB-V."""
    model = from_config(tiny(), 32)
    found = candidates(model, 16, load("a100-80gb"), 32)
    assert {layout.schedule for layout in found if layout.pp == 2} == {"1f1b", "interleaved", "zb-h1", "zb-v"}
    assert {layout.schedule for layout in found if layout.pp == 4} == {"1f1b", "zb-h1"}
    assert all(layout.chunks == 2 for layout in found if layout.schedule == "zb-v")
    only = candidates(model, 16, load("a100-80gb"), 32, schedules=("zb-h1",))
    assert {layout.schedule for layout in only if layout.pp > 1} == {"zb-h1"}


def test_a_fixed_layout_follows_the_search_flags_and_nothing_that_fits_is_refused_saying_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--fix leaves recompute and fsdp to --recompute and --fsdp where they say always or never (the search's row
    is priced again as printed); a cluster too small for any layout exits 2 naming the smallest need."""
    common = command(tmp_path)
    fix = ["--fix", "tp=2,pp=2,dp=4,micro_batch=1", "--json", str(tmp_path / "fixed.json")]
    assert main([*common, *fix, "--fsdp", "always", "--recompute", "never"]) == 0
    (row,) = json.loads((tmp_path / "fixed.json").read_text())
    assert row["fsdp"] is True and row["recompute"] == "never"
    assert main([*common, *fix]) == 0  # the defaults: recompute always, fsdp never
    (row,) = json.loads((tmp_path / "fixed.json").read_text())
    assert row["fsdp"] is False and row["recompute"] == "always"
    hardware = tmp_path / "small.json"
    small = load("a100-80gb").to_json()
    small["memory_bytes"] = 1e3
    hardware.write_text(json.dumps(small))
    capsys.readouterr()
    assert main([*common, "--hardware", str(hardware)]) == 2
    closest = r"the one needing the least memory, tp\d+ pp\d+ dp\d+ .*, needs [\d.]+ [GM]iB a device"
    assert re.search(r"no layout of the \d+ considered fits; " + closest, capsys.readouterr().err)


def test_memory_counts_the_score_matrix_only_where_attention_keeps_it() -> None:
    """A Hugging Face model is traced through fused attention (no s x s scores kept), Narayanan et al.'s GPT through
    the unfused one: Korthikanti et al.'s 5as/h term is in the latter's peak only."""
    from pipeengine.planner.cluster.layout import Layout

    model = from_config(tiny(), 32)
    layout = Layout(tp=1, pp=1, dp=1, micro_batch=4, num_microbatches=1, recompute=False)
    fused = price(model, layout, load("a100-80gb"))
    unfused = price(dataclasses.replace(model, fused_attention=False), layout, load("a100-80gb"))
    s, b, h, a = 32, 4, CONFIG["hidden_size"], CONFIG["num_attention_heads"]
    layers = CONFIG["num_hidden_layers"]  # without recomputation each layer keeps its whole activations
    assert unfused.peak_bytes - fused.peak_bytes == pytest.approx(layers * s * b * h * 5 * a * s / h)

"""Each example runs to completion in a reduced mode."""

import ast
import contextlib
import io
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeengine import consolidate, launch
from tests.pipeengine.processes import alive, descendants, parent

ROOT = Path(__file__).parent.parent


def run(*args: str, cwd: Path = ROOT) -> str:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=170, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.timeout(180)
def test_quickstart_learns_prints_the_loss_and_writes_its_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # on in-process ranks (threads: the same program, without 3 processes' start); train_gpt's test runs processes
    example("quickstart").cli(["--timeline", str(tmp_path / "last"), "--in-process"])  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step")]
    # its 10 steps show learning (once 0.45 -> 0.52): the one-process numbers are 0.61 -> 0.06
    assert len(losses) == 10 and losses[-1] < losses[0] / 4 and min(losses[-3:]) < min(losses[:3]) / 3, losses
    assert out.splitlines()[0].startswith("partition by time: 2 stages")
    assert (tmp_path / "last.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "last.json").stat().st_size > 0


@pytest.mark.timeout(120)
def test_plot_schedules_draws_every_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every schedule the registry holds, in its order, each at its own chunk count; docs/schedules.png is the figure
    it draws by default (as tall: one panel per schedule). Its main() in this process (no interpreter to start)."""
    from schedules import SCHEDULES

    plotting = example("plot_schedules")
    plotting.main(plotting.RANKS, plotting.MICROBATCHES, str(tmp_path / "schedules.png"))  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    drawn = [line.split(" (p=4, m=8, v=")[0] for line in out.splitlines() if " (p=4, m=8, v=" in line]
    assert drawn == list(SCHEDULES), drawn
    assert all(f"{name} (p=4, m=8, v={record.default_chunks})" in out for name, record in SCHEDULES.items()), out
    drawn_png, committed = (tmp_path / "schedules.png").read_bytes(), (ROOT / "docs" / "schedules.png").read_bytes()
    assert drawn_png[:4] == b"\x89PNG" and len(drawn_png) > 20_000
    assert committed[16:24] == drawn_png[16:24], "docs/schedules.png: run python examples/plot_schedules.py"  # size


GPT = [
    str(ROOT / "examples" / "train_gpt.py"),
    "--ranks",
    "2",
    "--tensor-parallel",
    "2",
    "--steps",
    "10",
    "--layers",
    "2",
    "--batch",
    "8",
    "--microbatches",
    "2",
    "--checkpoint-every",
    "5",
]


def uninterrupted(argv: list[str], printed: str) -> None:
    """A rank of train_gpt run as its command runs it (its main, on the parsed arguments), what it prints written
    into ``printed``.RANK: the ranks of this test's launch, whose fork server has imported torch already."""
    import torch.distributed as dist

    gpt = example("train_gpt")
    with open(f"{printed}.{dist.get_rank()}", "w") as out, contextlib.redirect_stdout(out):
        gpt.main(gpt.parser().parse_args(argv))  # type: ignore[attr-defined]


@pytest.mark.timeout(240)
def test_train_gpt_trains_samples_and_a_killed_rank_restarts_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    # the README's tensor-parallel command, smaller: 2 ranks, one stage over both (pipelining: test_gpt, test_parity);
    # launched from here (no second interpreter to import torch); the killed run below runs the command itself
    argv = [*GPT[1:], "--sample-chars", "5", "--log-every", "9", "--out", str(tmp_path / "whole")]
    launch(uninterrupted, 2, args=(argv, str(tmp_path / "printed")), timeout=170)
    out = (tmp_path / "printed.0").read_text()
    lines = out.splitlines()
    said = [line.split(" ")[0] for line in lines if line.endswith("...")]  # never silent while it works
    assert said == ["reading", "building", "sampling"], lines
    steps = [line for line in lines if line.startswith("step")]
    assert len(steps) == 2 and "tokens/s" in steps[0] and "bubble" in steps[-1]  # steps 0 and 9 (the last: traced)
    assert "bubble" not in steps[0] and any("bubble 0.0% simulated" in line for line in lines)  # 1 stage (tp=2)
    first, last = (float(line.split()[3]) for line in steps)
    assert first > 4.0 and last < first - 0.5, (first, last)  # about ln(96) = 4.56 at the start; it learns (-> 3.4)
    samples = [line for line in out.splitlines() if line.startswith("sample: 'def ")]
    assert len(samples) == 2 and all(len(eval(line[len("sample: ") :])) == 4 + 5 for line in samples)
    assert (tmp_path / "whole" / "timeline.png").stat().st_size > 10_000
    assert (tmp_path / "whole" / "timeline.json").exists()
    assert (tmp_path / "whole" / "latest").read_text() == "checkpoint-2"  # after step 5 and the last, 10

    # again, a rank SIGKILLed once the step drawn at random is printed: the launcher starts both ranks again, they
    # resume from the latest checkpoint and end on the same weights
    kill_after = random.Random().randrange(0, 9)
    command = [
        sys.executable,
        *GPT,
        "--sample-chars",
        "0",
        "--log-every",
        "1",
        "--max-restarts",
        "2",
        "--out",
        str(tmp_path / "killed"),
    ]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    printed, seen, killed = [], set(), None
    try:
        for line in job.stdout:  # type: ignore[union-attr]
            printed.append(line.rstrip())
            seen |= descendants(job.pid)
            if killed is None and line.startswith(f"step {kill_after:4d}"):
                killed = max(pid for pid in descendants(job.pid) if parent(parent(pid)) == job.pid)  # a rank
                os.kill(killed, signal.SIGKILL)
        assert job.wait(timeout=120) == 0, "\n".join(printed[-30:])
    finally:
        job.kill()
    why = f"killed after step {kill_after}:\n" + "\n".join(printed)
    assert killed is not None and any(
        "died from signal SIGKILL; every rank stopped, starting all 2 again" in line for line in printed
    ), why
    done = [int(line.split()[1]) for line in printed if line.startswith("step")]
    repeated = len(done) - len(set(done))
    assert sorted(set(done)) == list(range(10)) and repeated <= 5, why  # at most the steps since the checkpoint
    resumed_from = [line for line in printed if line.startswith("resumed from")]
    if kill_after % 5 != 4:  # (else the kill may land before or after the checkpoint written after the next step)
        assert len(resumed_from) == (kill_after >= 5), why
    whole, resumed = consolidate(tmp_path / "whole"), consolidate(tmp_path / "killed")
    assert [name for name in whole if not torch.equal(whole[name], resumed[name])] == [], why
    left = [pid for pid in seen if alive(pid)]
    assert not left, f"left behind: {left}"


@pytest.mark.timeout(180)
def test_finetune_hf_trains_and_writes_what_from_pretrained_loads_and_generate_hf_generates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    out = run(
        str(ROOT / "examples" / "finetune_hf.py"),
        "--packed",
        "--steps",
        "11",
        "--batch",
        "8",
        "--out",
        str(tmp_path / "ft"),
        "--generate",
        "12",
    )
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 2 and losses[-1] < losses[0] - 0.5, losses  # steps 0 and 10 of packed rows: 4.5 -> 3.1
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ft")
    assert type(model).__name__ == "LlamaForCausalLM" and model.lm_head.weight is model.model.embed_tokens.weight
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "ft")  # the characters' tokenizer, written beside it
    text = "def f(x):\n    return x"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text and len(tokenizer(text)["input_ids"]) == len(text)
    generated = [line for line in out.splitlines() if line.startswith("generated: ")]
    assert len(generated) == 1, out
    text = ast.literal_eval(generated[0].removeprefix("generated: "))  # the prompt and 12 characters after it
    assert text.startswith("def ") and len(text) == len("def ") + 12, text

    # the generating recipe on what it wrote, in this process: greedy gives the example's own text; sampled, other
    # characters, as many (the tokenizer's space and newline, which are its unknown and padding tokens, are kept)
    capsys.readouterr()
    generate_hf = example("generate_hf")
    generate_hf.main(["--model", str(tmp_path / "ft"), "--max-new-tokens", "12"])  # type: ignore[attr-defined]
    assert capsys.readouterr().out == text + "\n"
    generate_hf.main(
        [
            "--model",
            str(tmp_path / "ft"),
            "--prompt",
            "class",
            "--max-new-tokens",
            "9",
            "--sample",
            "--temperature",
            "2",
        ]
    )  # type: ignore[attr-defined]
    sampled = capsys.readouterr().out
    assert sampled.startswith("class") and len(sampled) == len("class") + 9 + 1, sampled


LOOP = [
    "--in-process",
    "--ranks",
    "2",
    "--log-every",
    "2",
    "--checkpoint-every",
    "2",
    "--samples",
    "64",
    "--batch",
    "8",
    "--length",
    "8",
    "--vocab",
    "16",
    "--width",
    "16",
    "--layers",
    "2",
    "--microbatches",
    "2",
    "--warmup",
    "1",
    "--lr",
    "3e-2",
]


@pytest.mark.timeout(60)
def test_train_loop_logs_each_interval_and_resumes_to_the_uninterrupted_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = example("train_loop")

    def run(*args: str) -> list[str]:
        loop.main([*LOOP, *args])  # type: ignore[attr-defined]  # in-process ranks: threads of this test
        return capsys.readouterr().out.splitlines()

    whole = run("--steps", "6", "--out", str(tmp_path / "whole"))  # 2 stages, 1F1B
    assert whole[0] == "1 replica(s) of a 2-rank pipeline, 1f1b, from step 0", whole
    logged = [line.split() for line in whole if line.startswith("step")]
    assert [int(words[1]) for words in logged] == [2, 4, 6], whole  # every --log-every steps
    for words in logged:  # step N  loss L  S samples/s  T tokens/s  peak M MiB  bubble B%
        assert [words[i] for i in (2, 5, 7, 8, 10, 11)] == ["loss", "samples/s", "tokens/s", "peak", "MiB", "bubble"]
        loss, samples, tokens, peak = float(words[3]), float(words[4]), float(words[6]), float(words[9])
        assert 0 < loss < 10 and samples > 0 and peak > 0, words  # (a nan loss fails 0 < loss)
        assert tokens == pytest.approx(samples * 8, rel=1e-3, abs=1), words  # --length tokens a sample
        assert words[12].endswith("%") and 0 <= float(words[12][:-1]) <= 100, words  # the traced step's bubble
    losses = [float(words[3]) for words in logged]
    assert losses[-1] < losses[0] - 0.3, losses  # about ln(16) = 2.77 at first; 2.73 -> 2.08 over the 6 steps
    assert whole[-1].startswith("final loss ") and whole[-1].endswith(" at step 6"), whole

    # stopped after step 4, then run again with --steps 6 and the same --out: the uninterrupted run, bit for bit
    assert run("--steps", "4", "--out", str(tmp_path / "resumed"))[-1].endswith(" at step 4")
    resumed = run("--steps", "6", "--out", str(tmp_path / "resumed"))
    assert resumed[0].endswith("resumed at step 4") and resumed[-1] == whole[-1], (resumed, whole)  # the final loss
    assert resumed[-2].split()[:4] == whole[-2].split()[:4], (resumed, whole)  # step 6's line: steps 5 and 6's loss
    first, second = consolidate(tmp_path / "whole"), consolidate(tmp_path / "resumed")
    assert list(first) == list(second) and all(torch.equal(first[k], second[k]) for k in first)

    # two replicas of a 1-rank pipeline read the same global batches between them: the same losses (to float sums)
    replicas = run("--steps", "6", "--data-parallel", "2", "--out", str(tmp_path / "replicas"))
    assert replicas[0].startswith("2 replica(s) of a 1-rank pipeline"), replicas
    assert [float(line.split()[3]) for line in replicas if line.startswith("step")] == pytest.approx(losses, abs=2e-4)

    # the progress bar: redrawn in place on a terminal (on stderr), nothing elsewhere (as under pytest, above)
    assert "[#" not in capsys.readouterr().err

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    loop.progress(3, 10, "step 13")  # type: ignore[attr-defined]
    assert sys.stderr.getvalue() == "\r\033[K[" + "#" * 9 + "." * 21 + "] step 13"  # type: ignore[attr-defined]


def example(name: str) -> object:
    """An example's module, imported as a library would (its `if __name__ == "__main__":` part not run; the examples
    folder on the path, as a script's own folder is)."""
    import importlib.util

    if str(ROOT / "examples") not in sys.path:
        sys.path.append(str(ROOT / "examples"))

    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.parametrize("name", ["quickstart", "train_gpt", "finetune_hf", "train_loop", "generate_hf"])
def test_every_examples_help_shows_each_option_with_its_default(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = example(name).parser()  # type: ignore[attr-defined]
    lines = parser.format_help().split("\noptions:\n", 1)[1].splitlines()
    for action in parser._actions:
        if action.default in (None, False, "==SUPPRESS==") or not action.option_strings:
            continue
        start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(action.option_strings[0]))
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("  -")), len(lines))
        said = " ".join(" ".join(lines[start:end]).split())
        assert f"(default: {action.default})" in said, (name, said)
    if name == "train_gpt":  # under torchrun (its processes per node in the environment), --ranks need not repeat it
        assert parser.parse_args([]).ranks == 4
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert example(name).parser().parse_args([]).ranks == 2  # type: ignore[attr-defined]

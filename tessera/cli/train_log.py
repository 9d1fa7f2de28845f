"""What `tessera train` shows while it trains: a progress bar in a terminal, plain lines elsewhere.

Without a terminal (output redirected to a file, as under Slurm or nohup), every logged step is
one line, flushed at once:

    step 12/100 | loss 6.1234 | 812 tok/s | MFU 23.4% | step 1.52 s, predicted 1.83 s (+20%) | peak mem 1.21 GiB

and each save, resume and evaluation gets a line of its own. In a terminal the same figures ride
on a rich progress bar, and the event lines are printed above it.
"""
from __future__ import annotations

import sys


def step_line(r, steps: int) -> str:
    """One logged step (a `StepRecord`) as a line of text."""
    parts = [f"step {r.step}/{steps}", f"loss {r.loss:.4f}", f"{r.tokens_per_s:,.0f} tok/s"]
    if r.mfu is not None:
        parts.append(f"MFU {100 * r.mfu:.1f}%")
    time = f"step {r.step_time_s:.2f} s"
    if r.predicted_step_time_s:
        err = (r.step_time_s - r.predicted_step_time_s) / r.predicted_step_time_s
        time += f", predicted {r.predicted_step_time_s:.2f} s ({err:+.0%})"
    parts.append(time)
    if r.peak_memory_bytes:
        parts.append(f"peak mem {max(r.peak_memory_bytes) / 2**30:.2f} GiB")
    if r.sp_groups:
        parts.append("sp groups " + " ".join("[" + ",".join(map(str, mb)) + "]" for mb in r.sp_groups))
    return " | ".join(parts)


def event_line(kind: str, info: dict) -> str:
    """A save, resume or evaluation, reported by the trainer's `on_event`."""
    if kind == "save":
        return f"saved checkpoint of step {info['step']} to {info['path']}"
    if kind == "resume":
        dropped = info.get("dropped_lines") or 0
        tail = f"; dropped {dropped} metrics line{'s' * (dropped != 1)} past it" if dropped else ""
        return f"resumed from {info['path']} at step {info['step']}{tail}"
    if kind == "eval":
        return (f"eval at step {info['step']}: loss {info['loss']:.4f}, perplexity {info['perplexity']:,.2f} "
                f"({info['tokens']:,} held-out tokens)")
    return f"{kind}: {info}"


class LineLog:
    """Plain lines, one per logged step and per event."""

    def __init__(self, steps: int, stream=None):
        self.steps, self.stream = steps, stream or sys.stdout

    def print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def start(self, headline: str, step: int) -> None:
        self.print(headline)

    def update(self, record) -> None:
        self.print(step_line(record, self.steps))

    def event(self, kind: str, info: dict) -> None:
        self.print(event_line(kind, info))

    def stop(self) -> None:
        pass


class BarLog(LineLog):
    """A rich progress bar carrying the last step's figures; events are printed above it."""

    def __init__(self, steps: int):
        super().__init__(steps)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        self.task = None

    def print(self, text: str) -> None:
        self.progress.console.print(text, markup=False, highlight=False)

    def start(self, headline: str, step: int) -> None:
        self.print(headline)
        self.progress.start()
        self.task = self.progress.add_task("train", total=self.steps, completed=step, info="")

    def update(self, record) -> None:
        info = " | ".join(step_line(record, self.steps).split(" | ")[1:])
        self.progress.update(self.task, completed=record.step, info=info)

    def stop(self) -> None:
        self.progress.stop()


class NoLog(LineLog):
    def print(self, text: str) -> None:
        pass


def make_log(mode: str, steps: int) -> LineLog:
    """`mode` "auto": a bar when stdout is a terminal, lines otherwise; "bar", "lines", "none"."""
    if mode == "auto":
        mode = "bar" if sys.stdout.isatty() else "lines"
    return {"bar": BarLog, "lines": LineLog, "none": NoLog}[mode](steps)

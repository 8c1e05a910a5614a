"""Whole benchmark runs alternated between variants, in one call on one machine.

    python -m benchmarks.alternate --variant k64: --variant k32:NANOPLANE_SKINNY_MAX_ROWS=32 --rounds 2
    python -m benchmarks.alternate --variant new: --variant old:@.ab/old -- --shape 8b

Two machines of one kind differ more on the same code than runs within one call do, so a change
worth less than a few percent shows only against the code before it, run by turns in the same call:
A B A B, never A A B B (a call's first run is often its slowest).

A variant is NAME:SETTINGS. SETTINGS is empty (the tree as it is), comma-separated ENV=VALUE pairs
set for its runs, or @DIR: the benchmark of another tree, e.g. `git archive <commit> | tar -x -C DIR`
(DIR relative to the repository root; a tree from before `benchmarks` was a package runs its
benchmarks/throughput.py as a script). Arguments after `--` go to every run. Each run's output is
kept under --out; the table at the end gives every run's tokens/s and seconds by kind of step, then
each variant's mean against the first variant's.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "benchmarks.throughput"  # a module run with -m, or a .py file run as a script
# throughput.py's result row ("| embedded 0.6b TP=1 | tokens | seconds | tok/s | ...") and its
# rows of seconds by kind of step ("| decode 17-64 rows | steps | seconds | ...").
RESULT = re.compile(r"^\| (embedded|service) [^|]*\| \d+ \| [\d.]+ \| ([\d,]+) \|", re.M)
BUCKET = re.compile(r"^\| (prefill[^|]*|decode [\d-]+ rows|all) \| \d+ \| ([\d.]+) \|", re.M)


@dataclass
class Variant:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    tree: Path = ROOT  # the tree whose benchmark runs

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """NAME:SETTINGS (see the module's docstring)."""
        name, sep, settings = spec.partition(":")
        if not sep or not name:
            raise ValueError(f"variant {spec!r}: expected NAME:SETTINGS, e.g. base: or k32:NANOPLANE_X=32")
        if settings.startswith("@"):
            tree = (ROOT / settings[1:]).resolve()
            if not (tree / script_file(SCRIPT)).is_file():
                raise ValueError(f"variant {name!r}: {tree / script_file(SCRIPT)} does not exist")
            return cls(name, tree=tree)
        env = {}
        for pair in filter(None, settings.split(",")):
            key, eq, value = pair.partition("=")
            if not eq or not key:
                raise ValueError(f"variant {name!r}: {pair!r} is not ENV=VALUE")
            env[key] = value
        return cls(name, env)


@dataclass
class Run:
    variant: str
    tok_s: float | None  # None: the run printed no result (see its log)
    seconds: dict[str, float]  # by kind of step


def script_file(script: str) -> Path:
    """The file behind SCRIPT: benchmarks.throughput -> benchmarks/throughput.py."""
    return Path(script) if script.endswith(".py") else Path(*script.split(".")).with_suffix(".py")


def command(tree: Path, script: str) -> list[str]:
    """How to run `script` in `tree`: -m where its folder is a package, else the file itself (older trees)."""
    path = script_file(script)
    if script.endswith(".py") or not (tree / path.parent / "__init__.py").is_file():
        return [sys.executable, str(path)]
    return [sys.executable, "-m", script]


def parse_output(variant: str, text: str) -> Run:
    result = RESULT.findall(text)
    tok_s = float(result[-1][1].replace(",", "")) if result else None
    return Run(variant, tok_s, {name: float(s) for name, s in BUCKET.findall(text)})


def run_once(variant: Variant, extra: list[str], log: Path, script: str, timeout: float) -> Run:
    """One run; a run past `timeout` seconds is killed and counts as failed (the others still run)."""
    env = {**os.environ, **variant.env}
    with open(log, "w") as out:
        # A session of its own: a service-mode run's server and ranks go with it when it is killed.
        proc = subprocess.Popen([*command(variant.tree, script), *extra], cwd=variant.tree, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.write(f"\nalternate.py: killed after {timeout:g} s\n")
            return Run(variant.name, None, {})
    return parse_output(variant.name, log.read_text())


def table(runs: list[Run]) -> list[str]:
    buckets = list(dict.fromkeys(name for r in runs for name in r.seconds))
    lines = ["| variant | tok/s |" + "".join(f" {b} s |" for b in buckets),
             "| --- | --- |" + " --- |" * len(buckets)]
    for r in runs:
        cells = "".join(f" {r.seconds[b]:.3f} |" if b in r.seconds else " - |" for b in buckets)
        tok_s = f"{r.tok_s:,.0f}" if r.tok_s is not None else "failed"
        lines.append(f"| {r.variant} | {tok_s} |{cells}")
    means = {}
    for r in runs:
        if r.tok_s is not None:
            means.setdefault(r.variant, []).append(r.tok_s)
    if means:
        first = next(iter(means))
        base = sum(means[first]) / len(means[first])
        for name, values in means.items():
            mean = sum(values) / len(values)
            lines.append(f"{name}: mean {mean:,.0f} tok/s over {len(values)} runs, "
                         f"{mean / base - 1:+.2%} against {first}")
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", required=True, help="NAME:SETTINGS (at least two)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each variant, taken in turns")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/nanoplane-alternate"), help="logs")
    parser.add_argument("--script", default=SCRIPT, help="a module (run with -m) or a .py file, in each tree")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a run may take before it is killed")
    args = parser.parse_args(ours)
    try:
        variants = [Variant.parse(spec) for spec in args.variant]
    except ValueError as e:
        parser.error(str(e))
    if len({v.name for v in variants}) != len(variants) or len(variants) < 2 or args.rounds < 1:
        parser.error("give two or more variants, each its own name, and one or more rounds")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    order = [(i, v) for i in range(args.rounds) for v in variants]
    for i, v in (bar := tqdm(order, desc="runs", unit="run")):
        run = run_once(v, extra, out / f"{v.name}-{i + 1}.txt", args.script, args.timeout)
        runs.append(run)
        bar.write(f"{v.name} round {i + 1}: " + (f"{run.tok_s:,.0f} tok/s" if run.tok_s is not None
                                                  else f"no result, see {out / f'{v.name}-{i + 1}.txt'}"))
    print("\n".join(table(runs)))


if __name__ == "__main__":
    main()

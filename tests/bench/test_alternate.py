"""benchmarks.alternate: variants parsed, runs taken in turns, throughput.py's tables read back.

The benchmark itself needs a GPU; here fake benchmarks print tables in throughput.py's format.
"""

import textwrap
from pathlib import Path

import pytest

from benchmarks import alternate

# Rows as throughput.py printed them on an H200 (8b99584).
EMBEDDED = """\
| steps | count | seconds | floor s | of floor | gap s | share of the gap | GPU busy s | GPU idle s |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| prefill (or mixed) | 9 | 0.280 | 0.160 | 57% | 0.120 | 12% | 0.275 | 0.000 |
| decode 1-16 rows | 54 | 0.078 | 0.031 | 40% | 0.047 | 4% | 0.078 | 0.000 |
| decode 129-256 rows | 497 | 2.673 | 2.243 | 84% | 0.430 | 41% | 2.672 | 0.001 |
| all | 1032 | 4.754 | 3.715 | 78% | 1.039 | 100% | 4.748 | 0.001 |
| mode | output tokens | time (s) | tok/s | floor tok/s | ratio | KV capacity (tokens) | peak GPU GiB | peak RSS GiB |
| embedded 0.6b TP=1 | 133966 | 4.76 | 28,139 | 36,400 | 77.3% | 1,132,032 | 124.4 | 2.1 |
"""
SERVICE = """\
| service 0.6b TP=1 | 133966 | 4.78 | 28,002 | 36,400 | 76.9% | 23,219 (1.21) | 0.5, 0.0, 0.0, 0.1, 0.0, 1.3 |
| service, one stream alone (512-token prompt, greedy) | TTFT 14.7 ms | inter-token 0.87 ms (median, at the client) |
"""


def test_reads_the_result_and_the_seconds_by_kind_of_step():
    run = alternate.parse_output("base", EMBEDDED)
    assert run.tok_s == 28139
    assert run.seconds == {"prefill (or mixed)": 0.280, "decode 1-16 rows": 0.078, "decode 129-256 rows": 2.673,
                           "all": 4.754}
    assert alternate.parse_output("svc", SERVICE).tok_s == 28002
    assert alternate.parse_output("broken", "Traceback (most recent call last):\n").tok_s is None


def test_variant_specs(tmp_path):
    assert alternate.Variant.parse("base:") == alternate.Variant("base")
    assert alternate.Variant.parse("k32:A=32,B=x=y").env == {"A": "32", "B": "x=y"}
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "throughput.py").write_text("")
    assert alternate.Variant.parse(f"old:@{tmp_path}").tree == tmp_path
    for bad in ("base", ":A=1", "k:A", "k:=1", "old:@/nonexistent/tree"):
        with pytest.raises(ValueError):
            alternate.Variant.parse(bad)


def fake_tree(root: Path, tok_s: int, package: bool) -> Path:
    """A tree whose benchmark prints `tok_s` (and the extra arguments it got, as a step kind); `package`:
    benchmarks/ is a package (run with -m), else a folder of scripts as in trees before it was one."""
    (root / "benchmarks").mkdir(parents=True)
    if package:
        (root / "benchmarks" / "__init__.py").write_text("")
    (root / "benchmarks" / "throughput.py").write_text(textwrap.dedent(f"""\
        import sys
        print("| decode " + "-".join(sys.argv[1:]) + " rows | 7 | 0.5 | 1 |")
        print("run as", __name__, __spec__.name if __spec__ else "a script")
        print("| embedded 0.6b TP=1 | 100 | 1.00 | {tok_s:,} | 36,400 |")
    """))
    return root


def test_runs_variants_in_turns_and_compares_their_means(tmp_path, capsys):
    new, old = fake_tree(tmp_path / "new", 1000, package=True), fake_tree(tmp_path / "old", 800, package=False)
    out = tmp_path / "logs"
    alternate.main(["--variant", f"new:@{new}", "--variant", f"old:@{old}", "--rounds", "2", "--out", str(out),
                    "--", "1", "16"])
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| new") or line.startswith("| old")]
    assert [r.split(" | ")[0] for r in rows] == ["| new", "| old", "| new", "| old"]  # A B A B
    assert rows[1] == "| old | 800 | 0.500 |"
    assert "| variant | tok/s | decode 1-16 rows s |" in printed  # the arguments after -- reached the runs
    assert "old: mean 800 tok/s over 2 runs, -20.00% against new" in printed
    assert sorted(p.name for p in out.iterdir()) == ["new-1.txt", "new-2.txt", "old-1.txt", "old-2.txt"]
    assert "run as __main__ benchmarks.throughput" in (out / "new-1.txt").read_text()
    assert "run as __main__ a script" in (out / "old-1.txt").read_text()


def test_environment_variants_and_a_failed_run(tmp_path, capsys):
    script = tmp_path / "bench.py"
    script.write_text(textwrap.dedent("""\
        import os, sys, time
        if os.environ.get("FAIL"):
            sys.exit("boom")
        if os.environ.get("HANG"):
            time.sleep(60)
        print("| embedded x | 1 | 1.0 | " + os.environ.get("TOKS", "500") + " | 2 |")
    """))
    alternate.main(["--variant", "base:", "--variant", "more:TOKS=600", "--variant", "bad:FAIL=1",
                    "--variant", "hung:HANG=1", "--rounds", "1", "--out", str(tmp_path / "logs"),
                    "--script", str(script), "--timeout", "3"])
    printed = capsys.readouterr().out
    assert "| bad | failed |\n" in printed and "| hung | failed |\n" in printed
    assert "killed after 3 s" in (tmp_path / "logs" / "hung-1.txt").read_text()
    assert "more: mean 600 tok/s over 1 runs, +20.00% against base" in printed
    assert "boom" in (tmp_path / "logs" / "bad-1.txt").read_text()


def test_needs_two_distinct_variants():
    with pytest.raises(SystemExit):
        alternate.main(["--variant", "a:"])
    with pytest.raises(SystemExit):
        alternate.main(["--variant", "a:", "--variant", "a:X=1"])

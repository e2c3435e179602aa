# Tests for `python -m hmoe.bench overhead`: a short CPU-only run in-process, its table and its JSON.
import json

import pytest

pytest.importorskip("torch")

from hmoe.bench import overhead as bench  # noqa: E402

DIRECT = ("grouped_topk", "moe_experts_cpu", "CPUExperts")
CUSTOM = {"torch.ops.hmoe.grouped_topk": "grouped_topk", "torch.ops.hmoe.moe_experts_cpu": "moe_experts_cpu",
          "torch.ops.hmoe.cpu_experts_packed": "CPUExperts"}
FLOOR = "torch dispatcher, no-op kernel"  # what torch's dispatcher alone costs a Python kernel


def test_cpu_rows_table_and_json(tmp_path, capsys):
    path = tmp_path / "overhead.json"
    rc = bench.main(["--cpu-only", "--calls", "3", "--blocks", "2", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {r["op"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == set(DIRECT) | set(CUSTOM) | {FLOOR}
    assert rows[FLOOR]["goal"] is None and "grouped_topk's schema" in rows[FLOOR]["shape"]
    for r in rows.values():
        assert r["device"] == "cpu" and r["calls"] == 6 and 0 < r["us_min"] <= r["us"], r
        assert "error" not in r and r["verdict"] in out
    for name in DIRECT:
        assert rows[name]["goal"] == bench.CPU_GOAL_US and rows[name]["verdict"].startswith("< 10 us: ")
    for name, direct in CUSTOM.items():
        r = rows[name]
        assert r["goal"] == ["custom", direct]
        # timed in blocks alternating with the direct call's: the medians of the pairs
        assert set(r["vs"]) == {direct} and r["vs"][direct]["ref_us"] == r["ref_us"] > 0
        assert r["added_us"] == r["vs"][direct]["added_us"] and r["vs"][direct]["ratio"] > 0
        assert r["us"] == r["vs"][direct]["us"] and r["us_min"] == r["vs"][direct]["us_min"]
        assert r["verdict"].startswith(f"{r['added_us']:+.2f} us, <= 5: ")
    assert "custom op (torch.ops.hmoe) at most 5 us more than the direct call" in out


def test_bad_arguments_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--calls", "0"])
    assert e.value.code == 2 and "--calls and --blocks must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [(["--threads", "5000"], "from 1 to 1024"),
                                         (["--json", "/nonexistent/dir/x.json"], "does not exist")])
def test_bad_options_are_refused_before_any_work(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv, "prog")
    assert e.value.code == 2 and words in capsys.readouterr().err

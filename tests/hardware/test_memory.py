"""hmoe.hardware.cpu.mem_available_bytes: /proc/meminfo's MemAvailable, or less where the process's memory
cgroup leaves less (read from fake cgroup v1 and v2 trees)."""
from hmoe.hardware import cpu

GIB = 1 << 30


def _tree(tmp_path, proc_line: str, groups: dict, v1: bool = False):
    """/proc/self/cgroup holding proc_line, and cgroup directories {relative path: (limit, usage, inactive)}."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text(f"3:cpuset:/\n{proc_line}\n")
    root = tmp_path / "fs"
    for rel, (limit, usage, inactive) in groups.items():
        d = root / ("memory" if v1 else "") / rel
        d.mkdir(parents=True, exist_ok=True)
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file") if v1 else \
            ("memory.max", "memory.current", "inactive_file")
        (d / names[0]).write_text(f"{limit}\n")
        (d / names[1]).write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"anon 4096\n{names[2]} {inactive}\nactive_file 8192\n")
    return str(proc), str(root)


def test_cgroup_v2_the_tightest_group_above_the_process(tmp_path):
    proc, root = _tree(tmp_path, "0::/kube/pod/app", {"": ("max", 50 * GIB, 0), "kube": ("max", 9 * GIB, 0),
                                                       "kube/pod": (10 * GIB, 4 * GIB, GIB),
                                                       "kube/pod/app": ("max", 3 * GIB, GIB)})
    assert cpu.cgroup_room(proc, root) == 10 * GIB - (4 * GIB - GIB)  # the inactive page cache is reclaimable


def test_cgroup_v2_inside_a_container_and_v1(tmp_path):
    proc, root = _tree(tmp_path / "a", "0::/", {"": (8 * GIB, 2 * GIB, 0)})
    assert cpu.cgroup_room(proc, root) == 6 * GIB
    unlimited = 9223372036854771712  # what v1 writes for no limit
    proc, root = _tree(tmp_path / "b", "4:memory:/a/b", {"a/b": (unlimited, GIB, 0), "a": (3 * GIB, GIB, GIB // 2),
                                                         "": (unlimited, 5 * GIB, 0)}, v1=True)
    assert cpu.cgroup_room(proc, root) == 3 * GIB - GIB // 2
    proc, root = _tree(tmp_path / "c", "5:cpu,memory:/x", {"x": (GIB, 2 * GIB, 0)}, v1=True)
    assert cpu.cgroup_room(proc, root) == 0  # over its limit already: no room, never negative


def test_no_limit_or_nothing_readable_is_none(tmp_path):
    proc, root = _tree(tmp_path / "a", "0::/app", {"": ("max", GIB, 0), "app": ("max", GIB, 0)})
    assert cpu.cgroup_room(proc, root) is None
    proc, root = _tree(tmp_path / "b", "0::/app", {})
    assert cpu.cgroup_room(proc, root) is None
    assert cpu.cgroup_room(str(tmp_path / "no-such-file"), root) is None
    (tmp_path / "bad").write_text("garbage without colons\n")
    assert cpu.cgroup_room(str(tmp_path / "bad"), root) is None


def test_mem_available_is_the_lesser_of_meminfo_and_the_cgroup(monkeypatch):
    monkeypatch.setattr(cpu, "cgroup_room", lambda: None)
    plain = cpu.mem_available_bytes()
    assert plain > 0
    monkeypatch.setattr(cpu, "cgroup_room", lambda: plain // 2)
    assert cpu.mem_available_bytes() == plain // 2
    monkeypatch.setattr(cpu, "cgroup_room", lambda: 2 * plain)
    assert cpu.mem_available_bytes() <= plain + (plain // 10)  # MemAvailable, as it moves between the calls

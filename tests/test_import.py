"""import hmoe stays cheap: no native module, no torch, no CUDA, no NVML until an op needs them;
build_info() reads the baked manifest without loading anything either."""
import json
import subprocess
import sys

CODE = """
import json, sys
import hmoe
info = hmoe.build_info()
loaded = sorted(m for m in sys.modules if m.startswith("hmoe._native.") and m != "hmoe._native.signatures")
print(json.dumps({"native": loaded, "torch": "torch" in sys.modules, "pynvml": "pynvml" in sys.modules,
                  "version": info["version"], "cpu_modules": sorted(info["cpu_modules"])}))
"""


def test_import_loads_nothing_native():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["native"] == [] and not got["torch"] and not got["pynvml"]
    assert got["version"] and got["cpu_modules"], got


def test_build_info_lists_every_cpu_level_of_this_processor():
    import hmoe
    from hmoe.hardware import cpu

    info = hmoe.build_info()
    built = {e["isa"] for e in info["cpu_modules"].values() if e["op"] == "experts"}
    assert built == {lv["name"] for lv in cpu.levels()}
    for entry in info["cpu_modules"].values():
        assert "-march=native" not in entry["flags"]
    assert info["git_revision"] and info["cxx_compiler"]


def test_python_m_hmoe_names_the_commands():
    ok = subprocess.run([sys.executable, "-m", "hmoe"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "python -m hmoe.compat check" in ok.stdout and "python -m hmoe.bench" in ok.stdout, ok
    bad = subprocess.run([sys.executable, "-m", "hmoe", "check"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "takes no command of its own" in bad.stderr and not bad.stdout, bad

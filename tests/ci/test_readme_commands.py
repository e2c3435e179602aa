"""ci/readme_commands.py finds the README's two commands, which .ci/run executes as written."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "readme_commands.py"

pytestmark = pytest.mark.skipif(not (SCRIPT.exists() and (ROOT / "README.md").exists()),
                                reason="needs the source tree (ci/ and README.md)")


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_the_readme_has_two_commands_that_install_the_test_extra():
    install, tests = run(1).stdout.strip(), run(2).stdout.strip()
    assert "pip install" in install and ".[test]" in install, install
    assert "pytest tests" in tests, tests


def test_a_readme_without_two_commands_fails(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## The two commands\n\n```bash\npip install .\n```\n\n## Next\n\n```bash\nls\n```\n")
    p = run(1, readme)
    assert p.returncode == 1 and "found 1" in p.stderr
    readme.write_text("# x\n\n## Setup\n")
    assert run(2, readme).returncode != 0
    assert run(3).returncode == 2

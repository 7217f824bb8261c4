"""No dead code: vulture finds nothing unused in the packages, beyond the reviewed whitelist
(framework hooks are found by name: Textual's compose/on_*/action_*, numba's typingctx)."""
import subprocess
import sys

from tests.conftest import ROOT

HOOKS = "compose,on_*,action_*,BINDINGS,CSS_PATH,TITLE,DEFAULT_CSS,border_title,border_subtitle,placeholder,theme," \
        "watch_*,pytest_*,typingctx"


def test_vulture_finds_no_unused_code():
    proc = subprocess.run([sys.executable, "-m", "vulture", "app", "core", "models", "kernels", "tests",
                           "--min-confidence", "60", "--ignore-names", HOOKS], cwd=ROOT, capture_output=True, text=True)
    found = [line for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 0 and not found, "\n".join(found) + proc.stderr

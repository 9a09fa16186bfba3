"""The web process loads the wire contract, never the sandbox backends or the Docker SDK."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
import django
django.setup()
import kestrel_one.urls, kestrel_one.wsgi
from runners.contract import registry, tokens
loaded = sorted(
    name for name in sys.modules
    if name == "docker" or name.startswith(("docker.", "runners.sandbox", "runners.worker"))
)
print(json.dumps({"loaded": loaded, "tools": sorted(registry.TOOLS)}))
"""


@pytest.mark.spec("EXT-1")
def test_the_web_app_never_imports_docker_or_the_sandbox_backends():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "kestrel_one.settings_test"}
    # A fresh interpreter: this test process itself has loaded the backends for other tests.
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr
    answer = json.loads(probe.stdout.strip().splitlines()[-1])
    # The web process does read every tool's spec...
    assert "shell.exec" in answer["tools"]
    # ...without the machinery that runs them.
    assert answer["loaded"] == []

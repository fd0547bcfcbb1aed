"""The JavaScript SDK (web/clonecast.js) tested with Node's own test runner against real
servers: web/test/*.test.mjs, run by this test with the servers' addresses in its environment
(Node >= 20 with --experimental-websocket for the global WebSocket; the `ws` package from
web/node_modules, installed by the test command, for the injected-constructor tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.service.conftest import reference_audio

ROOT = Path(__file__).resolve().parents[2]
WEB = ROOT / "web"


def test_the_javascript_sdk_against_a_real_server(make_server, tmp_path):
    node = shutil.which("node")
    assert node, "Node.js >= 20 is needed for the JavaScript SDK's tests (apt-get install nodejs)"
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout
    assert int(version.lstrip("v").split(".")[0]) >= 20, f"Node.js >= 20 is needed, not {version}"
    assert (WEB / "node_modules" / "ws").is_dir(), "run `npm ci` in web/ (make test does)"
    plain = make_server(max_segment_chars=24)
    keyed = make_server(api_keys=("js-test-key",))
    reference = tmp_path / "reference.wav"
    reference.write_bytes(reference_audio(2.0))
    env = {
        **os.environ,
        "CLONECAST_URL": plain.ws,
        "CLONECAST_AUTH_URL": keyed.ws,
        "CLONECAST_AUTH_HTTP": keyed.http,
        "CLONECAST_KEY": "js-test-key",
        "CLONECAST_REFERENCE": str(reference),
    }
    tests = sorted(str(p) for p in (WEB / "test").glob("*.test.mjs"))
    assert tests
    declared = sum(Path(t).read_text().count("\ntest(") for t in tests)
    result = subprocess.run(
        [node, "--experimental-websocket", "--test", "--test-reporter=tap", *tests],
        cwd=WEB,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert f"# pass {declared}\n" in report and "# fail 0\n" in report, report  # all ran

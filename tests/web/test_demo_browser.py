"""The demo page (web/index.html) driven in headless Chromium (Debian's, through Playwright;
no browser is ever downloaded) against a real server: it speaks and plays as the audio
streams, shows the latencies, Stop cancels at once, a bad upload shows its error, the
untrained-model banner shows, and everything works from the keyboard. Screenshots go to
artifacts/ (ignored by git)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
FAKE_MIC = ROOT / "web" / "samples" / "voice.wav"  # what the fake microphone "hears", once
CHROMIUM_ARGS = [
    "--use-fake-ui-for-media-stream",  # grants the microphone
    "--use-fake-device-for-media-stream",
    f"--use-file-for-fake-audio-capture={FAKE_MIC}%noloop",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--autoplay-policy=no-user-gesture-required",
]


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    assert chromium, "Chromium is needed: run `make test` as root, or apt-get install chromium"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def demo_server(make_server):
    return make_server()


@pytest.fixture
def page(browser, demo_server):
    context = browser.new_context()
    page = context.new_page()
    page.goto(demo_server.http + "/")
    page.wait_for_function("document.getElementById('untrained').hidden === false")
    yield page
    context.close()


def _sampling(page, **fields) -> None:
    """Opens the Sampling controls (as a user would) and sets the given fields."""
    if not page.evaluate("document.querySelector('details').open"):
        page.click("summary")
    for name, value in fields.items():
        page.fill(f"#{name.replace('_', '-')}", str(value))


def _drawn(page, canvas_id: str) -> bool:
    """Whether anything was painted on the canvas."""
    return page.evaluate(
        """id => {
            const c = document.getElementById(id);
            const data = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
            return data.some((v, i) => i % 4 === 3 && v > 0);
        }""",
        canvas_id,
    )


def _state(page) -> dict:
    return page.evaluate("() => ({...window.__clonecast})")


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"demo-{name}.png"), full_page=True)


def test_speak_plays_the_stream_and_shows_its_latency(page):
    assert "random weights" in page.locator("#untrained").inner_text()
    assert page.locator("#insecure").is_hidden()  # 127.0.0.1 is a secure context
    page.fill("#text", "Hello from the browser.")
    _sampling(page, seed=3, max_duration=2)
    page.click("#speak")
    page.wait_for_function("window.__clonecast.state === 'done'", timeout=60000)
    page.wait_for_function("window.__clonecast.framesPlayed >= window.__clonecast.bytes / 2")
    state = _state(page)
    assert state["bytes"] == 2 * 25 * 1920 and state["chunks"] >= 2
    assert state["framesPlayed"] == state["bytes"] // 2  # every sample reached the speakers
    assert state["ttfaMs"] > 0 and state["serverTtfaMs"] > 0
    assert page.locator("#ttfa-client").inner_text().endswith(" ms")
    assert page.locator("#ttfa-server").inner_text() == f"{state['serverTtfaMs']} ms"
    assert page.locator("#caption").inner_text() == "Hello from the browser."
    assert page.locator("#download").is_enabled()
    # the timeline: one step per chunk, none late on this fast server, and drawn
    timeline = state["timeline"]
    assert len(timeline) == state["chunks"]
    assert [round(p["audio"] * 24000 * 2) for p in timeline][-1] == state["bytes"]
    assert _drawn(page, "timeline") and _drawn(page, "waveform")
    _shot(page, "done")


def test_stop_cancels_at_once_and_no_audio_follows(page):
    page.fill("#text", "A long utterance that the listener interrupts.")
    _sampling(page, seed=1, max_duration=30)  # seeded: runs its 30 s (no early eos) until Stop
    page.click("#speak")
    page.wait_for_function("window.__clonecast.chunks >= 1", timeout=60000)
    page.click("#stop")
    page.wait_for_function("window.__clonecast.state === 'cancelled'", timeout=30000)
    chunks, played = _state(page)["chunks"], _state(page)["framesPlayed"]
    page.wait_for_timeout(1500)
    after = _state(page)
    assert after["chunks"] == chunks, "audio arrived after the cancel"
    assert after["framesPlayed"] - played < 24000 * 0.1, "playback went on after Stop"
    assert after["bytes"] < 30 * 25 * 1920
    assert page.locator("#speak").is_enabled() and page.locator("#stop").is_disabled()


def test_a_bad_upload_shows_the_servers_error_in_words(page, tmp_path):
    bad = tmp_path / "not-audio.wav"
    bad.write_bytes(b"this is not audio at all")
    page.select_option("#voice-source", "file")
    page.set_input_files("#voice-file", str(bad))
    page.click("#speak")
    page.wait_for_function("window.__clonecast.error !== null", timeout=60000)
    error = page.locator("#error")
    assert error.is_visible() and "(audio_" in error.inner_text()
    assert _state(page)["error"]["code"].startswith("audio_")
    _shot(page, "error")


def test_the_page_works_from_the_keyboard_alone(page):
    page.locator("#text").focus()
    page.keyboard.press("Control+A")
    page.keyboard.type("Typed and spoken without a mouse.")
    for _ in range(3):  # past the type-and-hear checkbox to the Sampling summary
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.tagName") == "SUMMARY":
            break
    assert page.evaluate("document.activeElement.tagName") == "SUMMARY"  # Enter opens it
    page.keyboard.press("Enter")
    for _ in range(4):  # Tab to the seed field (seeded: an exact length) and type there
        page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "seed"
    page.keyboard.type("1")
    page.keyboard.press("Tab")  # on to the longest-sentence field and type there
    assert page.evaluate("document.activeElement.id") == "max-duration"
    page.keyboard.press("Control+A")
    page.keyboard.type("1")
    for _ in range(10):  # Tab along the form until the Speak button has the focus
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "speak":
            break
    assert page.evaluate("document.activeElement.id") == "speak"
    page.keyboard.press("Enter")
    page.wait_for_function("window.__clonecast.state === 'done'", timeout=60000)
    assert _state(page)["bytes"] == 25 * 1920


def test_the_bundled_sample_voice_is_cloned(page):
    page.select_option("#voice-source", "sample")
    assert page.locator("#file-fields").is_hidden() and page.locator("#mic-fields").is_hidden()
    page.fill("#text", "Now in the sample voice.")
    _sampling(page, seed=5, max_duration=1)
    page.click("#speak")
    page.wait_for_function("window.__clonecast.state === 'done'", timeout=60000)
    state = _state(page)
    assert state["voiceId"].startswith("v_") and state["bytes"] == 25 * 1920


def test_a_voice_recorded_with_the_microphone_is_cloned(page):
    """The fake microphone plays web/samples/voice.wav once: a few seconds are recorded in an
    AudioWorklet, sent as a WAV the server decodes, and the clone speaks."""
    page.select_option("#voice-source", "mic")
    page.click("#record")
    # recording starts once the microphone and the worklet are up: time it from there
    page.wait_for_selector("#record[aria-pressed=true]")
    page.wait_for_timeout(2500)
    page.click("#record")
    page.wait_for_function("window.__clonecast.recordedSeconds > 0")
    seconds = _state(page)["recordedSeconds"]
    assert 2.0 <= seconds <= 4.0, seconds
    assert "s recorded" in page.locator("#recorded").inner_text()
    page.fill("#text", "Spoken in the recorded voice.")
    _sampling(page, seed=6, max_duration=1)
    page.click("#speak")
    page.wait_for_function("window.__clonecast.state === 'done'", timeout=60000)
    state = _state(page)
    assert state["error"] is None and state["voiceId"].startswith("v_")
    assert state["bytes"] == 25 * 1920


def test_type_and_hear_speaks_each_sentence_as_it_is_typed(page):
    """Appended as typed: the first sentence is heard before the text is finished; Enter
    flushes the rest and ends the utterance."""
    page.check("#type-and-hear")
    _sampling(page, seed=9, max_duration=1)
    page.fill("#text", "")
    page.locator("#text").focus()
    page.keyboard.type("First sentence. ", delay=20)
    page.wait_for_function("window.__clonecast.chunks >= 1", timeout=60000)
    assert _state(page)["state"] == "speaking"  # heard while the text is still open
    page.keyboard.type("And the second", delay=20)
    page.keyboard.press("Enter")
    page.wait_for_function("window.__clonecast.state === 'done'", timeout=60000)
    state = _state(page)
    assert state["captions"] == ["First sentence.", "And the second"]
    assert state["bytes"] == 2 * 25 * 1920
    assert page.locator("#text").input_value() == "First sentence. And the second"  # no newline


def test_download_saves_what_was_heard_as_a_wav(page, tmp_path):
    _sampling(page, seed=4, max_duration=1)
    page.click("#speak")
    page.wait_for_function("window.__clonecast.state === 'done'", timeout=60000)
    with page.expect_download() as info:
        page.click("#download")
    path = tmp_path / "heard.wav"
    info.value.save_as(path)
    import soundfile as sf

    audio, rate = sf.read(path, dtype="int16")
    assert rate == 24000 and len(audio) == 25 * 960 and abs(audio).max() > 0


def test_with_api_keys_the_page_connects_with_a_short_lived_token_only(browser, make_server):
    """The page never holds an API key: its backend mints a token and puts it in the page's
    address; without one the page shows the server's refusal."""
    import httpx

    keyed = make_server(api_keys=("page-key",))
    minted = httpx.post(
        keyed.http + "/v1/tokens",
        json={"ttl_s": 120, "origin": keyed.http},
        headers={"Authorization": "Bearer page-key"},
        timeout=30,
    )
    token = minted.json()["token"]
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(f"{keyed.http}/?token={token}")
        page.wait_for_function("document.getElementById('untrained').hidden === false")
        _sampling(page, seed=2, max_duration=1)
        page.click("#speak")
        page.wait_for_function("window.__clonecast.state === 'done'", timeout=60000)
        refused = context.new_page()
        refused.goto(keyed.http + "/")
        refused.wait_for_function("window.__clonecast.error !== null", timeout=30000)
        assert _state(refused)["error"]["code"] == "unauthorized"
        assert "(unauthorized)" in refused.locator("#error").inner_text()
    finally:
        context.close()


def test_a_narrow_screen_and_the_dark_scheme(browser, demo_server):
    """At 360 px nothing needs a horizontal scroll; with a dark system scheme the page is
    dark (its own colours, not the browser's defaults)."""
    context = browser.new_context(viewport={"width": 360, "height": 740}, color_scheme="dark")
    try:
        page = context.new_page()
        page.goto(demo_server.http + "/")
        page.wait_for_function("document.getElementById('untrained').hidden === false")
        assert page.evaluate("document.documentElement.scrollWidth") <= 360
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        red, green, blue = (int(v) for v in background[4:-1].split(",")[:3])
        assert red + green + blue < 3 * 64, background
        _shot(page, "narrow-dark")
    finally:
        context.close()


def test_another_output_rate_is_resampled_by_the_server_and_played_at_it(page, tmp_path):
    _sampling(page, seed=4, max_duration=1)
    page.select_option("#output-rate", "16000")
    page.click("#speak")
    page.wait_for_function("window.__clonecast.state === 'done'", timeout=60000)
    page.wait_for_function("window.__clonecast.framesPlayed >= 16000")
    state = _state(page)
    assert state["bytes"] == 16000 * 2 and state["framesPlayed"] == 16000
    with page.expect_download() as info:
        page.click("#download")
    info.value.save_as(tmp_path / "heard.wav")
    import soundfile as sf

    audio, rate = sf.read(tmp_path / "heard.wav", dtype="int16")
    assert rate == 16000 and len(audio) == 16000


def test_in_chromium_a_refused_ping_rejects_alone_and_the_socket_stays(page):
    """The SDK as the page loads it, over Chromium's own WebSocket: 180 pings at once go over
    the connection's burst of 100; the refused ones reject with rate_limited (matched by
    request_id), every other one gets its pong, and the connection goes on. (The bucket
    refills 50 a second while the server reads the flood: with 110 pings a loaded CI machine
    once read them slowly enough to refuse none. 180 stay under the 100 refusals that close
    a connection.)"""
    got = page.evaluate(
        """async () => {
            const { connect, ClonecastError } = await import("/clonecast.js");
            const url = location.origin.replace("http", "ws") + "/v1/stream";
            const client = await connect({ url });
            const settled = (p) => Promise.race([  // a ping left unsettled fails, not hangs
                p.then((pong) => pong.type,
                       (e) => (e instanceof ClonecastError ? e.code : String(e))),
                new Promise((resolve) => setTimeout(() => resolve("unsettled"), 10000)),
            ]);
            const results = await Promise.all(Array.from({ length: 180 }, () =>
                settled(client.ping())));
            await new Promise((resolve) => setTimeout(resolve, 500));  // the bucket refills
            const after = (await client.ping()).type;
            client.close();
            return { results, after };
        }"""
    )
    refused = [r for r in got["results"] if r != "pong"]
    assert 1 <= len(refused) <= 80 and set(refused) == {"rate_limited"}, got["results"]
    assert got["after"] == "pong"

"""docs/tensorboard.png: TensorBoard's Custom Scalars page of a real run, in a real browser.

    python scripts/tensorboard_screenshot.py [--dump DIR] [--steps 20] [--skip-run]

Trains train_configs/e2e_cpu.toml with SAB + DST (./run_train.sh, 2 CPU processes, as
bench/e2e.py does), serves its TensorBoard folder on 127.0.0.1, and has headless
Chromium (`chromium`, Debian's package) render the Custom Scalars tab and capture it.
Chromium is driven over its DevTools pipe (no extra Python package) so that the page's
own settings can be set first: no smoothing, outliers not clipped. Needs Pillow (the
`plot` extra) to store the capture as a 64-colour PNG.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "tensorboard.png"
WIDTH, HEIGHT = 1400, 2360


# Open every chart's "Matches" list (which tag each line draws); the page's elements
# sit inside nested shadow roots.
OPEN_LEGENDS = """
(() => {
  const walk = (root, out) => {
    for (const el of root.querySelectorAll('*')) {
      if (el.shadowRoot) walk(el.shadowRoot, out);
      if (el.classList.contains('toggle-matches-button')) out.push(el);
    }
    return out;
  };
  const found = walk(document, []);
  found.forEach(el => el.click());
  return found.length;
})()
"""


def train(dump: Path, steps: int) -> None:
    env = dict(os.environ, CONFIG_FILE="train_configs/e2e_cpu.toml", NGPU="2", MAX_RESTARTS="0")
    args = ["./run_train.sh", "--dump_folder", str(dump), "--training.steps", str(steps)]
    args += ["--sab.policy", "sab", "--dst.enabled"]
    subprocess.run(args, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DevTools:
    """Chrome DevTools Protocol over --remote-debugging-pipe: JSON messages, each ended
    by a NUL byte, written to the browser's fd 3 and read from its fd 4."""

    def __init__(self, chromium: str = "chromium") -> None:
        to_browser, self._send_fd = os.pipe()
        self._recv_fd, from_browser = os.pipe()

        def fds() -> None:  # in the child: its fd 3 and 4 are the two pipe ends
            read_end, write_end = os.dup(to_browser), os.dup(from_browser)  # not 3 or 4
            os.dup2(read_end, 3)
            os.dup2(write_end, 4)

        args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
        args += ["--remote-debugging-pipe", f"--window-size={WIDTH},{HEIGHT}", "about:blank"]
        # pass_fds names the child's fds after `fds` ran (the rest are closed then).
        self.proc = subprocess.Popen(
            args, pass_fds=(3, 4), preexec_fn=fds, stderr=subprocess.DEVNULL
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer, self._next_id, self.session = b"", 0, None

    def call(self, method: str, **params):
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if self.session is not None:
            message["sessionId"] = self.session
        os.write(self._send_fd, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._recv_fd, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed its DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT,
                  deviceScaleFactor=1, mobile=False)  # fmt: skip
        self.call("Page.navigate", url=url)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _compact(png: bytes) -> bytes:
    """A 64-colour palette: the page is a few flat colours, so the file shrinks from
    ~290 KB to ~110 KB and looks the same."""
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    buffer = io.BytesIO()
    image.quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(buffer, "PNG", optimize=True)
    return buffer.getvalue()


def screenshot(logdir: Path, out: Path) -> None:
    port = _free_port()
    tensorboard = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir)]
    tensorboard += ["--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(tensorboard, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    browser = None
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(120):  # until it serves the layout
            try:
                urllib.request.urlopen(f"{base}/data/plugin/custom_scalars/layout", timeout=2)
                break
            except OSError:
                time.sleep(1)
        browser = DevTools()
        browser.open(f"{base}/?darkMode=false#custom_scalars&_smoothingWeight=0")
        time.sleep(10)
        # A per-browser setting (local storage): draw every point, outliers included.
        setting = "localStorage.setItem('_ignoreYOutliers', 'false')"
        browser.call("Runtime.evaluate", expression=setting)
        browser.call("Page.reload")
        time.sleep(15)  # the charts load their data after the page
        browser.call("Runtime.evaluate", expression=OPEN_LEGENDS)
        time.sleep(3)
        shot = browser.call("Page.captureScreenshot", format="png")
        out.write_bytes(_compact(base64.b64decode(shot["data"])))
    finally:
        if browser is not None:
            browser.close()
        server.kill()
        server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", type=Path, default=REPO / "outputs" / "tensorboard_screenshot")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-run", action="store_true", help="reuse the run already in --dump")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if not args.skip_run:
        train(args.dump, args.steps)
    screenshot(args.dump / "tb", args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()

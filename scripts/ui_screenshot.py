"""Screenshot of the playground (docs/ui.png): a server on the shipped default family with its
EAGLE3 head, the page in headless Chromium (Debian's, driven by Playwright; no browser download),
one greedy completion streamed, then the picture.

    python3 scripts/ui_screenshot.py [--out docs/ui.png] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as "
          "many clips in May. How many clips did Natalia sell altogether in April and May?\nAnswer:")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "ui.png"))
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"),
                        help="the Chromium binary (default: chromium on PATH)")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    if not args.chromium:
        parser.error("no Chromium found: apt-get install chromium, or pass --chromium PATH")

    import torch
    from playwright.sync_api import sync_playwright

    from foretell.config import build_engine_config
    from foretell.defaults import member_path
    from foretell.engine.engine import Engine
    from foretell.server.api import build_app
    from foretell.server.async_engine import AsyncEngine
    from foretell.server.launcher import BackgroundServer

    torch.set_num_threads(1)
    spec = {"method": "eagle3", "model": member_path("eagle3"), "num_speculative_tokens": 3}
    config = build_engine_config(member_path("target"), num_kv_blocks=128, speculative_config=spec,
                                 log_stats_interval_s=0.0)
    async_engine = AsyncEngine(config, engine_factory=lambda: Engine(config))
    server = BackgroundServer(build_app(async_engine, "qwen3-target"), async_engine).start()
    try:
        if not async_engine.wait_ready(timeout=120):
            raise RuntimeError(f"the engine did not load: {async_engine.load_error}")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 860}, device_scale_factor=1)
            page.goto(server.url + "/")
            page.wait_for_selector("#legend .tok")
            page.fill("#prompt", PROMPT)
            page.fill("#max-tokens", str(args.max_tokens))
            page.check("#ignore-eos")
            page.click("#run")
            page.wait_for_selector("#output[data-done='true']", timeout=120_000)
            page.wait_for_timeout(1200)  # one more /stats poll for the server panel
            page.locator("#output .o-corrected").last.hover()  # its tooltip below the text
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out, full_page=True)
            browser.close()
    finally:
        server.stop()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How this project drives a browser (the browser tests and the latency benchmark): Debian's chromium, never a
downloaded one, headless, with nothing that would reach the network."""

CHROMIUM_PATH = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
